// DeepSeek-V4's decode attention over the paged rows (engine/executor/cpu_dsv4_attention.py dsv4_attention with
// one query per sequence; cpu_dsv4_ops.sink_attention): query row t at position p (-1: padding, zeros out), head
// h, attends with scale to one shared K = V head of d values over
//   * its sliding window: the rows at positions max(0, p - window + 1) .. p (column 0 of the layer's rows);
//   * the compressed entries it may see (rate > 0): with `topk` > 0 (CSA) the entries ids[t, :topk] the
//     lightning indexer picked (-1: none), else (HCA) every closed entry e < (p + 1) / rate; entry e sits in the
//     row of its window's last token, position (e + 1) · rate - 1, at column entry_col;
// and its learned sink s_h takes part in the softmax's denominator only:
//   o = sum_j exp(l_j - m) v_j / (sum_j exp(l_j - m) + exp(s_h - m)),  l_j = scale · q · k_j,  m = max(l, s_h).
// Fixed grid and no host reads (graph-capturable): a row's keys are found on the device from its position, its
// block table and the indexer's ids; every bound is an argument.
//
// The rows are the layer's bf16 [slots, row_width], read through tables [T, max_blocks] (row t: token t's
// sequence's blocks) as rows_at does. One CTA per (row, head), ATT_WARPS warps: warp w takes keys w, w + ATT_WARPS,
// .., its lanes splitting d, keeping its own online softmax (max, sum, accumulator); the warps' partials merge in
// shared memory with the sink. d <= ATT_MAX_D.
//
// Roofline per row: (window + keys) · d · 2 bytes of K = V from DRAM (V4-Flash, window 128 + top-k 512 of 512
// values: 655 KB a CSA layer, 128 + context/128 entries an HCA one), ~0.2 µs at 3 TB/s; the heads' CTAs read the
// same keys again from L2 (one KV head): L2-bandwidth-bound at heads × those bytes. A CTA over a group of heads
// sharing each key load is the step beyond.
//
// write_rows (below): the step's float32 K rows [T, width] stored as bf16 at their KV slots from column col,
// skipping slot -1 (padding, or a position a prefix hit restored and the step replays): a fixed-shape write a
// graph can hold.
#include "common.cuh"

#define ATT_WARPS 4
#define ATT_THREADS (32 * ATT_WARPS)
#define ATT_MAX_D 1024
#define ATT_PER_LANE (ATT_MAX_D / 32)

// The position of key j of row t (-1: none): the window's first, then the entries' rows.
__device__ __forceinline__ int key_position(int j, int p, const int* __restrict__ ids, int window, int rate,
                                            int topk) {
    if (j < window) {
        const int at = p - window + 1 + j;
        return at >= 0 ? at : -1;
    }
    const int e = topk ? ids[j - window] : j - window;
    return e >= 0 ? (e + 1) * rate - 1 : -1;
}

// sparse_decode: grid (T, heads), ATT_THREADS threads. q float32 [T, heads, d] (roped); kv: the layer's bf16 rows;
// tables int32 [T, max_blocks]; positions int32 [T]; ids int32 [T, topk] (read only when topk > 0); sinks float32
// [heads]; out float32 [T, heads, d].
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
sparse_decode(const float* __restrict__ q, const bf16_t* __restrict__ kv, const int* __restrict__ tables,
              const int* __restrict__ positions, const int* __restrict__ ids, const float* __restrict__ sinks,
              float* __restrict__ out, int max_blocks, int block, int row_width, int d, int window, int rate,
              int topk, int entry_col, float scale) {
    pdl_begin();
    __shared__ float qs[ATT_MAX_D], part[ATT_WARPS][ATT_MAX_D], wmax[ATT_WARPS], wsum[ATT_WARPS];
    const int t = blockIdx.x, h = blockIdx.y, heads = gridDim.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p = positions[t];
    float* o = out + ((size_t)t * heads + h) * d;
    if (p < 0) {                                                          // the whole CTA
        for (int c = threadIdx.x; c < d; c += ATT_THREADS) o[c] = 0.f;
        return;
    }
    for (int c = threadIdx.x; c < d; c += ATT_THREADS) qs[c] = q[((size_t)t * heads + h) * d + c];
    __syncthreads();
    const int* table = tables + (size_t)t * max_blocks;
    const int entries = rate ? (topk ? topk : (p + 1) / rate) : 0;
    float m = -INFINITY, l = 0.f, acc[ATT_PER_LANE];
    #pragma unroll
    for (int i = 0; i < ATT_PER_LANE; ++i) acc[i] = 0.f;
    for (int j = warp; j < window + entries; j += ATT_WARPS) {
        const int at = key_position(j, p, ids + (size_t)t * topk, window, rate, topk);
        if (at < 0) continue;                                             // the whole warp
        const bf16_t* k = kv + ((size_t)table[at / block] * block + at % block) * row_width
                          + (j < window ? 0 : entry_col);
        float v[ATT_PER_LANE], dot = 0.f;
        #pragma unroll
        for (int i = 0; i < ATT_PER_LANE; ++i) {
            const int c = lane + 32 * i;
            v[i] = c < d ? bf16_to_f(k[c]) : 0.f;
            dot += c < d ? qs[c] * v[i] : 0.f;
        }
        const float s = warp_sum(dot) * scale, mn = fmaxf(m, s), corr = expf(m - mn), e = expf(s - mn);
        l = l * corr + e;
        #pragma unroll
        for (int i = 0; i < ATT_PER_LANE; ++i) acc[i] = acc[i] * corr + e * v[i];
        m = mn;
    }
    #pragma unroll
    for (int i = 0; i < ATT_PER_LANE; ++i)
        if (lane + 32 * i < d) part[warp][lane + 32 * i] = acc[i];
    if (lane == 0) wmax[warp] = m, wsum[warp] = l;
    __syncthreads();
    float mx = sinks[h];
    for (int w = 0; w < ATT_WARPS; ++w) mx = fmaxf(mx, wmax[w]);
    float den = expf(sinks[h] - mx), f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; ++w) f[w] = expf(wmax[w] - mx), den += wsum[w] * f[w];
    for (int c = threadIdx.x; c < d; c += ATT_THREADS) {
        float y = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w) y += part[w][c] * f[w];
        o[c] = y / den;
    }
}

// write_rows: grid (T), ATT_THREADS threads. rows float32 [T, width] -> kv[slots[t], col:col + width] as bf16.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
write_rows(bf16_t* kv, const int* __restrict__ slots, const float* __restrict__ rows, int width, int row_width,
           int col) {
    pdl_begin();
    const int t = blockIdx.x, slot = slots[t];
    if (slot < 0) return;
    for (int c = threadIdx.x; c < width; c += ATT_THREADS)
        kv[(size_t)slot * row_width + col + c] = f_to_bf16(rows[(size_t)t * width + c]);
}
