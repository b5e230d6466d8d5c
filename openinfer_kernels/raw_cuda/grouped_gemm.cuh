// The frame the grouped (MoE) prefill GEMMs share (w4_grouped_gemm.cu, fp8_grouped_gemm.cu): a CTA of 4 warps takes
// 64 of moe_align's expert-grouped token rows x 128 weight rows.
//   grouped_block_rows  the block's real rows (groups fill their tiles from the top; 0: the block is padding)
//   staged_steps        the main loop: step s's activation tile staged (cp.async) while step s - 1 is used, in two
//                       buffers; the step body gets the buffer (a constant once unrolled) and the step
//   grouped_gemm_store  the epilogue: warp w's c[t][n] is the mma C fragment of weight rows 32w + 16t .. + 15 and
//                       token rows 8n .. 8n + 7 (mma.cuh: c0, c1 = rows g, c2, c3 = g + 8 of the weight tile,
//                       tokens 2tq, 2tq + 1); through shared memory `o` ([64][GS_PITCH] bf16, the staging buffers
//                       once the main loop is done) to 16-byte stores of out [rows, N]: real rows only (padding rows
//                       never written), columns past N dropped.
#pragma once
#include "common.cuh"

#define GS_ROWS 64
#define GS_COLS 128
#define GS_PITCH 136                      // bf16 a staged row: 128 + 8 (rows 272 bytes apart: no bank conflicts)
#define GS_BYTES (GS_ROWS * GS_PITCH * 2)

__device__ __forceinline__ int grouped_block_rows(const int* __restrict__ row_token, int m0) {
    if (row_token[m0] < 0) return 0;
    int rows = 1;
    while (rows < GS_ROWS && row_token[m0 + rows] >= 0) ++rows;
    return rows;
}

// stage(buf, s) issues step s's cp.async group into buffer buf; step(buf, s) uses it. Step 0 is staged by the caller.
template <typename Stage, typename Step>
__device__ __forceinline__ void staged_steps(int steps, Stage stage, Step step) {
    for (int s0 = 0; s0 < steps; s0 += 2) {
        #pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int s = s0 + u;
            if (s >= steps) break;
            if (s + 1 < steps) { stage(u ^ 1, s + 1); cp_async_wait<1>(); }
            else cp_async_wait<0>();
            __syncthreads();                         // step s's tile is in buffer u for every thread
            step(u, s);
            __syncthreads();                         // buffer u is restaged by the next step
        }
    }
}

template <int NT>
__device__ __forceinline__ void grouped_gemm_store(const float (&c)[2][NT][4], bf16_t* o, bf16_t* __restrict__ out,
                                                   int m0, int rows, int n0, int N) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    #pragma unroll
    for (int t = 0; t < 2; ++t)
        #pragma unroll
        for (int n = 0; n < NT; ++n)
            #pragma unroll
            for (int j = 0; j < 4; ++j)
                o[(8 * n + 2 * tq + (j & 1)) * GS_PITCH + 32 * warp + 16 * t + g + 8 * (j >> 1)] =
                    f_to_bf16(c[t][n][j]);
    __syncthreads();
    for (int i = threadIdx.x; i < GS_ROWS * GS_COLS / 8; i += blockDim.x) {
        const int r = i / (GS_COLS / 8), col = n0 + i % (GS_COLS / 8) * 8;
        if (r >= rows || col >= N) continue;
        bf16_t* dst = out + (size_t)(m0 + r) * N + col;
        const bf16_t* src = o + r * GS_PITCH + (col - n0);
        if (N % 8 == 0) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        else for (int j = 0; j < 8 && col + j < N; ++j) dst[j] = src[j];
    }
}
