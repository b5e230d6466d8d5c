// Grouped (MoE) GEMV for decode-sized steps, in place of the grouped GEMM when a step has few tokens:
// for every real row r of the expert-grouped activations (moe_align.cu: each expert's rows at the top of
// its tile_m-row tiles, row_token < 0 below them),
//   out[r, n] = bf16(sum_k a[r, k] · w[tile_expert[r / tile_m], n, k])     (fp32 accumulation)
// a [M, K], w [E, N, K], out [M, N] bf16; K % 8 == 0. Grid (ceil(N / 32), tiles), 128 threads: each warp
// owns 8 output columns of one tile and its lanes split k in 16-byte pieces; per 256-wide k step a lane
// issues the 8 columns' weight loads together (and the compiler the next step's, unroll 2), so a warp
// keeps 4-8 KB of weights in flight: a decode step reads few experts, and without that memory-level
// parallelism (the first version walked one column at a time: one 16-byte load per lane outstanding)
// it ran at a fifth of the bandwidth, slower than the padded grouped GEMM. ROWS of the tile's real rows
// are reduced at a time (a column's weights are read once per ROWS rows; a decode tile holds one to a
// few). Padding tiles exit at once, padding rows are never written. A fixed grid: graph-capturable.
// Roofline: the used experts' weights, (tiles with a real row) · N · K · 2 bytes, read once: at batch 1
// on Qwen3-30B-A3B 8 experts' 768 x 2048 gate_up halves and down, ~75 MB per layer, 18 µs at 4.2 TB/s.
#include "common.cuh"

#define COLS_PER_WARP 8
#define ROWS 4

__device__ __forceinline__ float dot8(uint4 x, uint4 y) {
    const bf16_t* xs = reinterpret_cast<const bf16_t*>(&x);
    const bf16_t* ys = reinterpret_cast<const bf16_t*>(&y);
    float s = 0.f;
    #pragma unroll
    for (int e = 0; e < 8; ++e) s += bf16_to_f(xs[e]) * bf16_to_f(ys[e]);
    return s;
}

extern "C" __global__ void __launch_bounds__(128)
moe_gemv(const bf16_t* __restrict__ a, const bf16_t* __restrict__ w, const int* __restrict__ tile_expert,
         const int* __restrict__ row_token, bf16_t* __restrict__ out, int N, int K, int tile_m) {
    pdl_begin();
    const int m0 = blockIdx.y * tile_m;
    if (row_token[m0] < 0) return;
    int rows = 1;
    while (rows < tile_m && row_token[m0 + rows] >= 0) ++rows;
    const bf16_t* wexp = w + (size_t)tile_expert[blockIdx.y] * N * K;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_first = (blockIdx.x * 4 + warp) * COLS_PER_WARP;
    if (n_first >= N) return;
    const bf16_t* wrow[COLS_PER_WARP];
    #pragma unroll
    for (int j = 0; j < COLS_PER_WARP; ++j) wrow[j] = wexp + (size_t)min(n_first + j, N - 1) * K;
    for (int r0 = 0; r0 < rows; r0 += ROWS) {
        const int nr = min(ROWS, rows - r0);
        float acc[ROWS][COLS_PER_WARP];
        #pragma unroll
        for (int r = 0; r < ROWS; ++r)
            #pragma unroll
            for (int j = 0; j < COLS_PER_WARP; ++j) acc[r][j] = 0.f;
        #pragma unroll 2
        for (int k = lane * 8; k < K; k += 256) {
            uint4 wv[COLS_PER_WARP];
            #pragma unroll
            for (int j = 0; j < COLS_PER_WARP; ++j) wv[j] = *reinterpret_cast<const uint4*>(wrow[j] + k);
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < nr) {
                    const uint4 av = *reinterpret_cast<const uint4*>(a + (size_t)(m0 + r0 + r) * K + k);
                    #pragma unroll
                    for (int j = 0; j < COLS_PER_WARP; ++j) acc[r][j] += dot8(wv[j], av);
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < nr) {
                #pragma unroll
                for (int j = 0; j < COLS_PER_WARP; ++j) {
                    const float s = warp_sum(acc[r][j]);
                    if (lane == 0 && n_first + j < N) out[(size_t)(m0 + r0 + r) * N + n_first + j] = f_to_bf16(s);
                }
            }
        }
    }
}
