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
// The host emulation of the tests (tests/cuda_emulation.h) defines both for g++.
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
#endif
