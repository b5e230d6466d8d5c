// Warp-wide tensor-core products by inline PTX (no <mma.h>: NVRTC's pip headers lack crt/mma.h), fp32
// accumulation, lane = 4·g + t (g = groupID, t = threadID_in_group):
//   mma_16816:     c[16x8] += a[16x16] · b[16x8], bf16 (mma.sync.aligned.m16n8k16.row.col)
//     a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
//     b0 = B[2t..2t+1][g], b1 = B[2t+8..][g]
//   mma_16832_e4m3: c[16x8] += a[16x32] · b[32x8], fp8 e4m3 (mma.sync.aligned.m16n8k32.row.col, sm_89+),
//     four values per register, the lowest byte first:
//     a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][4t+16..], a3 = A[g+8][4t+16..];
//     b0 = B[4t..4t+3][g], b1 = B[4t+16..][g]
//   both: c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..].
//   ldmatrix_x4_trans: four 8x8 bf16 tiles of shared memory, transposed: lane l gives the address of row l % 8
//     of tile l / 8 and receives, of tile i, elements (2·(l % 4), l / 4) and (2·(l % 4) + 1, l / 4) in r[i]
//     (low half first): the B fragment of mma.m16n8k16 when the tile's rows are k and its columns n.
// The host emulation of the tests (tests/cuda_emulation.h) defines them for g++.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define MMA_SYNC_F32(NAME, INSTRUCTION)                                                                     \
    __device__ __forceinline__ void NAME(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,     \
                                         unsigned b0, unsigned b1) {                                        \
        asm volatile(INSTRUCTION " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                               \
    }
MMA_SYNC_F32(mma_16816, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
MMA_SYNC_F32(mma_16832_e4m3, "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32")

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const bf16_t* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
#endif

// Two floats as a bf16 pair (each rounded to nearest even), the first in the low half: an mma operand register.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)f_to_bf16(lo) | ((unsigned)f_to_bf16(hi) << 16);
}
