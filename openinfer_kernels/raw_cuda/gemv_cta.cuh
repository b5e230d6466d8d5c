// The CTA frame of the decode GEMVs (gemv.cu, gemv_w4.cu, gemv_fp8.cu). A CTA holds RT row tiles of 16 weight
// rows, KW warps a tile, each warp with the mma accumulators of its tile over its share of K: c[n][j] of lane
// (g, tq) is y[m = 8n + 2tq + (j & 1), row = row0 + g + 8·(j >> 1)] (mma.cuh's C fragment); the B operand of
// n8 tile n is x row 8n + g (gemv_x_rows). gemv_store sums the KW warps of each tile in shared memory (in
// warp order) and writes y with the epilogue:
//   EPI_NONE      y = the sum (bf16 or float32 by OutT)
//   EPI_RESIDUAL  y = bf16(bf16(sum) + res_in)   (res_in may be y)
//   EPI_SILU      y[M, N/2] = silu_mul of a gate_up product whose weight rows interleave 8 gate and 8 up
//                 rows (gpu_gemm.interleave_gate_up): a tile's rows g and g + 8 are gate and up of output
//                 column row0 / 2 + g, and only the threads of slots j < 2 store.
#pragma once
#include "common.cuh"

// x rows of this lane's B fragments (row 8n + g of each n8 tile; rows past M read row 0, masked by ok).
template <int NT, typename T>
__device__ __forceinline__ void gemv_x_rows(const T* x, int M, size_t row_stride, int g, const T* (&rows)[NT],
                                            bool (&ok)[NT]) {
    #pragma unroll
    for (int n = 0; n < NT; ++n) {
        ok[n] = n * 8 + g < M;
        rows[n] = x + (ok[n] ? n * 8 + g : 0) * row_stride;
    }
}

#define EPI_NONE 0
#define EPI_RESIDUAL 1
#define EPI_SILU 2

__device__ __forceinline__ void gemv_out(bf16_t* y, size_t i, float v) { y[i] = f_to_bf16(v); }
__device__ __forceinline__ void gemv_out(float* y, size_t i, float v) { y[i] = v; }

// rt, kw: this warp's tile and its place among the tile's warps; row0: the first weight row of CTA tile 0;
// red: the CTA's shared reduction buffer.
template <int NT, int RT, int KW>
using GemvPartials = float[RT][KW][NT * 4][32];

template <int NT, int EPI, int RT, int KW, typename OutT>
__device__ __forceinline__ void gemv_store(const float (&c)[NT][4], GemvPartials<NT, RT, KW>& red, int rt, int kw,
                                           OutT* y, int M, int N, int row0, const bf16_t* res_in) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int n = 0; n < NT; ++n)
        #pragma unroll
        for (int j = 0; j < 4; ++j) red[rt][kw][n * 4 + j][lane] = c[n][j];
    __syncthreads();
    // Thread i sums one accumulator slot of one tile over its warps and stores it.
    for (int i = threadIdx.x; i < RT * NT * 4 * 32; i += blockDim.x) {
        const int tile = RT == 1 ? 0 : i / (NT * 4 * 32), slot = RT == 1 ? i / 32 : i / 32 % (NT * 4);
        const int ln = i % 32, n = slot / 4, j = slot % 4;
        const int tile_row0 = row0 + 16 * tile;
        const int m = n * 8 + (ln & 3) * 2 + (j & 1), row = tile_row0 + (ln >> 2) + 8 * (j >> 1);
        if (m >= M || row >= N || (EPI == EPI_SILU && j >= 2)) continue;
        float v = 0.f, up = 0.f;
        #pragma unroll
        for (int wp = 0; wp < KW; ++wp) {
            v += red[tile][wp][slot][ln];
            if (EPI == EPI_SILU) up += red[tile][wp][slot + 2][ln];
        }
        if (EPI == EPI_SILU) {                       // silu_mul.cu's arithmetic on the bf16 linear outputs
            const float act = bf16_to_f(silu_times(round_bf16(v), round_bf16(up)));   // exact in bf16
            gemv_out(y, (size_t)m * (N / 2) + tile_row0 / 2 + (ln >> 2), act);
            continue;
        }
        const size_t at = (size_t)m * N + row;
        if (EPI == EPI_RESIDUAL) v = round_bf16(v) + bf16_to_f(res_in[at]);
        gemv_out(y, at, v);
    }
}

// The runtime-chosen epilogue of the quantized GEMVs' entries: epi 0 bf16 y, 1 float32 y (y is then a
// float*), 2 residual, 3 SiLU·up (the EPI_* above; 0 and 1 are EPI_NONE).
#define GEMV_EPI_BF16 0
#define GEMV_EPI_F32 1
#define GEMV_EPI_RESIDUAL 2
#define GEMV_EPI_SILU 3

template <int NT, int RT, int KW>
__device__ __forceinline__ void gemv_store_epi(const float (&c)[NT][4], int rt, int kw, void* y, int M, int N,
                                               int row0, const bf16_t* res_in, int epi) {
    __shared__ GemvPartials<NT, RT, KW> red;
    bf16_t* yb = static_cast<bf16_t*>(y);
    switch (epi) {
        case GEMV_EPI_F32: gemv_store<NT, EPI_NONE>(c, red, rt, kw, static_cast<float*>(y), M, N, row0, res_in); break;
        case GEMV_EPI_RESIDUAL: gemv_store<NT, EPI_RESIDUAL>(c, red, rt, kw, yb, M, N, row0, res_in); break;
        case GEMV_EPI_SILU: gemv_store<NT, EPI_SILU>(c, red, rt, kw, yb, M, N, row0, res_in); break;
        default: gemv_store<NT, EPI_NONE>(c, red, rt, kw, yb, M, N, row0, res_in);
    }
}

// A dense quantized GEMV's CTA (grid ceil(N/16 / RT), 8 warps): warp w takes tile blockIdx.x·RT + w / KW and
// k share w % KW, dots(tile, kw, c) accumulates it (and runs pdl_wait); warps of tiles past N only wait.
template <int NT, int RT, int KW, typename Dots>
__device__ __forceinline__ void gemv_dense(Dots dots, void* y, int M, int N, const bf16_t* res_in, int epi) {
    const int warp = threadIdx.x >> 5, rt = warp / KW, kw = warp % KW;
    const int tile = blockIdx.x * RT + rt;
    float c[NT][4] = {};
    if (tile * 16 < N) dots(tile, kw, c);
    else pdl_begin();
    gemv_store_epi<NT, RT, KW>(c, rt, kw, y, M, N, blockIdx.x * RT * 16, res_in, epi);
}

// A grouped (MoE) GEMV's CTA on moe_align.cu's expert-grouped rows (grid (ceil(N/16 / RT), tiles)): a tile's
// real rows (row_token >= 0, at its top) in chunks of 16, dots(first row, rows, tile, kw, c) for each; out
// [rows, N] bf16, padding rows never written, padding tiles exit at once.
template <int RT, int KW, typename Dots>
__device__ __forceinline__ void gemv_grouped(Dots dots, const int* __restrict__ row_token, int tile_m, bf16_t* out,
                                             int N) {
    pdl_begin();
    const int m0 = blockIdx.y * tile_m;
    if (row_token[m0] < 0) return;
    int rows = 1;
    while (rows < tile_m && row_token[m0 + rows] >= 0) ++rows;
    const int warp = threadIdx.x >> 5, rt = warp / KW, kw = warp % KW;
    const int tile = blockIdx.x * RT + rt;
    for (int r0 = 0; r0 < rows; r0 += 16) {
        float c[2][4] = {};
        if (tile * 16 < N) dots(m0 + r0, min(16, rows - r0), tile, kw, c);
        gemv_store_epi<2, RT, KW>(c, rt, kw, out + (size_t)(m0 + r0) * N, min(16, rows - r0), N, blockIdx.x * RT * 16,
                                  nullptr, GEMV_EPI_BF16);
        __syncthreads();             // the shared partials are rewritten by the next chunk
    }
}
