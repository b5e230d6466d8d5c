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
#ifndef MOE_UNROLL
#define MOE_UNROLL 2            // 256-wide k steps whose weight loads a lane issues together (warp_dots)
#endif
#ifndef COMBINE_COLS
#define COMBINE_COLS 8          // moe_gemv_combine: output columns per CTA (gpu_moe_ops.COMBINE_COLS)
#endif
#define PRAGMA_(x) _Pragma(#x)
#define UNROLL_BY(n) PRAGMA_(unroll n)

__device__ __forceinline__ float dot8(uint4 x, uint4 y) {
    const bf16_t* xs = reinterpret_cast<const bf16_t*>(&x);
    const bf16_t* ys = reinterpret_cast<const bf16_t*>(&y);
    float s = 0.f;
    #pragma unroll
    for (int e = 0; e < 8; ++e) s += bf16_to_f(xs[e]) * bf16_to_f(ys[e]);
    return s;
}

// acc[r][j] += the lane's share of a[r] · wrow[j] over K (r < nr): per 256-wide k step the lane loads its
// 16-byte piece of the C weight rows together (MOE_UNROLL steps at a time), then each row's piece of a. The
// caller sums the lanes (warp_sum). Every kernel here runs this loop, so a column's sum does not depend on
// the kernel, nor on C or MOE_UNROLL (each lane adds its pieces in k order).
template <int R, int C>
__device__ __forceinline__ void warp_dots(const bf16_t* __restrict__ a, size_t a_stride, int nr,
                                          const bf16_t* const (&wrow)[C], int K, float (&acc)[R][C]) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int j = 0; j < C; ++j) acc[r][j] = 0.f;
    UNROLL_BY(MOE_UNROLL)
    for (int k = lane * 8; k < K; k += 256) {
        uint4 wv[C];
        #pragma unroll
        for (int j = 0; j < C; ++j) wv[j] = *reinterpret_cast<const uint4*>(wrow[j] + k);
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < nr) {
                const uint4 av = *reinterpret_cast<const uint4*>(a + r * a_stride + k);
                #pragma unroll
                for (int j = 0; j < C; ++j) acc[r][j] += dot8(wv[j], av);
            }
        }
    }
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
        warp_dots<ROWS, COLS_PER_WARP>(a + (size_t)(m0 + r0) * K, K, nr, wrow, K, acc);
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

// The experts of a step of a few tokens without grouping them (no moe_align, gather, silu_mul or combine
// launch): each (token, slot) assignment reads its expert straight from ids (a slot shared by two tokens
// reads the expert twice, so this pays below a handful of tokens; ids < 0, another rank's experts, are
// skipped). Each column's sum is the same as moe_gemv's (warp_dots), each rounding as the grouped path
// (bf16 gate / up, silu_mul's SiLU·up, bf16 expert outputs, moe_combine's fp32 slot-order sum).
//
// moe_gemv_silu: act[s, c] = silu_times(bf16(x[s / top_k] · gate_c), bf16(x[s / top_k] · up_c)) for the
// expert ids[s]; gate_up [E, 2I, H] with gate / up rows interleaved in blocks of 8 (interleaved = 1,
// gpu_gemm.interleave_gate_up) or [gate | up]. Grid (ceil(I / 16), T·top_k), 128 threads: each warp owns 4
// act columns, i.e. 4 gate and 4 up rows (8 weight rows, as moe_gemv's warps).
extern "C" __global__ void __launch_bounds__(128)
moe_gemv_silu(const bf16_t* __restrict__ x, const bf16_t* __restrict__ gate_up, const int* __restrict__ ids,
              bf16_t* __restrict__ act, int I, int H, int top_k, int interleaved) {
    pdl_begin();
    const int s = blockIdx.y, e = ids[s];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (blockIdx.x * 4 + warp) * 4;
    if (e < 0 || c0 >= I) return;
    const bf16_t* wexp = gate_up + (size_t)e * 2 * I * H;
    const bf16_t* wrow[COLS_PER_WARP];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int c = min(c0 + j, I - 1);
        const int g = interleaved ? (c / 8) * 16 + c % 8 : c;
        wrow[j] = wexp + (size_t)g * H;
        wrow[j + 4] = wexp + (size_t)(interleaved ? g + 8 : I + c) * H;
    }
    float acc[1][COLS_PER_WARP];
    warp_dots<1, COLS_PER_WARP>(x + (size_t)(s / top_k) * H, H, 1, wrow, H, acc);
    float sums[COLS_PER_WARP];
    #pragma unroll
    for (int j = 0; j < COLS_PER_WARP; ++j) sums[j] = warp_sum(acc[0][j]);
    if (lane < 4 && c0 + lane < I) {
        float g = sums[0], u = sums[4];
        #pragma unroll
        for (int j = 1; j < 4; ++j) if (lane == j) { g = sums[j]; u = sums[j + 4]; }
        act[(size_t)s * I + c0 + lane] = silu_times(round_bf16(g), round_bf16(u));
    }
}

// moe_gemv_combine: out[t, n] = bf16(residual[t, n] + sum_k weights[t, k] · bf16(act[t·top_k + k] · down[ids[t, k], n]))
// (fp32 sum in slot order). Grid (ceil(H / COMBINE_COLS), T), 32·min(top_k, 8) threads: warp w takes slots
// w, w + 8, ..., each for the CTA's COMBINE_COLS columns; the CTA's first COMBINE_COLS threads sum the slots.
// out may be residual (each element read, then written, by one thread). top_k <= MAX_SLOTS.
#define MAX_SLOTS 32
extern "C" __global__ void __launch_bounds__(256)
moe_gemv_combine(const bf16_t* __restrict__ act, const bf16_t* __restrict__ down, const int* __restrict__ ids,
                 const float* __restrict__ weights, const bf16_t* residual, bf16_t* out, int H, int I, int top_k) {
    pdl_begin();
    __shared__ float ys[MAX_SLOTS][COMBINE_COLS];
    const int t = blockIdx.y, warps = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = blockIdx.x * COMBINE_COLS;
    // The summing threads' residual values go out with the weights, not after them.
    const int j = threadIdx.x;
    const size_t at = (size_t)t * H + n0 + j;
    const float res = j < COMBINE_COLS && n0 + j < H ? bf16_to_f(residual[at]) : 0.f;
    for (int k = warp; k < top_k; k += warps) {
        const int e = ids[t * top_k + k];
        if (e < 0) continue;
        const bf16_t* wrow[COMBINE_COLS];
        #pragma unroll
        for (int c = 0; c < COMBINE_COLS; ++c) wrow[c] = down + ((size_t)e * H + min(n0 + c, H - 1)) * I;
        float acc[1][COMBINE_COLS];
        warp_dots<1, COMBINE_COLS>(act + (size_t)(t * top_k + k) * I, I, 1, wrow, I, acc);
        #pragma unroll
        for (int c = 0; c < COMBINE_COLS; ++c) {
            const float v = warp_sum(acc[0][c]);
            if (lane == c) ys[k][c] = round_bf16(v);
        }
    }
    __syncthreads();
    if (j < COMBINE_COLS && n0 + j < H) {
        float sum = 0.f;
        for (int k = 0; k < top_k; ++k)
            if (ids[t * top_k + k] >= 0) sum += weights[t * top_k + k] * ys[k][j];
        out[at] = f_to_bf16(res + sum);
    }
}
