// DeepSeek-V4's lightning indexer (engine/executor/cpu_dsv4_attention.py indexer_pick, transformers'
// DeepseekV4Indexer): for each query row r, the score of each closed entry e < n_r = (position_r + 1) / rate of
// its sequence, score[e] = scale · sum_h w[r, h] · relu(q[r, h] · k[e]), then the top `topk` entries by score,
// equal scores the lower entry first, written as ascending entry ids into ids [rows, topk] (-1 padded) with
// counts [rows] = min(n_r, topk). No host reads and fixed shapes per launch (graph-capturable): the grid
// covers `stride` entries a row and a CTA past its row's n_r returns at once.
//
// The keys are read through the paged rows as rows_at does: entry e's key sits in the row of its window's last
// token, position (e + 1) · rate - 1, at column `col` of the layer's [slots, row_width] bf16 rows, its slot
// tables[r, at / block] · block + at % block. IDX_H heads of IDX_D values (compile-time: a thread's IDX_H
// dot products stay in registers).
//
// Roofline per query row over n entries: the scores read n · IDX_D · 2 bytes of keys and do n · IDX_H · IDX_D
// FMAs (V4-Flash, 64 heads of 128: 32 FMAs per key byte, past the H100's ~9 FP32 FMAs per byte of DRAM
// bandwidth: compute-bound on the CUDA cores, a tensor-core product is the step beyond); they write 4 · n bytes,
// which the top-k reads five times (four 8-bit radix passes and the output pass, from L2) with one CTA a row.
#include "common.cuh"

#ifndef IDX_H
#define IDX_H 4
#endif
#ifndef IDX_D
#define IDX_D 16
#endif
#define IDX_THREADS 128                 // entries per CTA of the scores, a thread each
#define TOPK_THREADS 256

// Entries closed at a query's position (-1: a padding row, none).
__device__ __forceinline__ int closed_entries(int position, int rate) { return position < 0 ? 0 : (position + 1) / rate; }

// indexer_scores: grid (ceil(stride / IDX_THREADS), rows), IDX_THREADS threads. q float32 [rows, IDX_H, IDX_D],
// w float32 [rows, IDX_H], kv: the layer's bf16 rows [slots, row_width] (col, row_width multiples of 4),
// tables int32 [rows, max_blocks], positions int32 [rows]; scores float32 [rows, stride] (entries < n_r written).
extern "C" __global__ void __launch_bounds__(IDX_THREADS)
indexer_scores(const float* __restrict__ q, const float* __restrict__ w, const bf16_t* __restrict__ kv,
               const int* __restrict__ tables, const int* __restrict__ positions, float* __restrict__ scores,
               int stride, int max_blocks, int block, int row_width, int col, int rate, float scale) {
    pdl_begin();
    __shared__ float qs[IDX_H * IDX_D], ws[IDX_H];
    const int r = blockIdx.y, e = blockIdx.x * IDX_THREADS + threadIdx.x;
    const int n = min(closed_entries(positions[r], rate), stride);
    if ((int)blockIdx.x * IDX_THREADS >= n) return;                      // the whole CTA
    for (int i = threadIdx.x; i < IDX_H * IDX_D; i += IDX_THREADS) qs[i] = q[(size_t)r * IDX_H * IDX_D + i];
    for (int i = threadIdx.x; i < IDX_H; i += IDX_THREADS) ws[i] = w[(size_t)r * IDX_H + i];
    __syncthreads();
    if (e >= n) return;
    const int at = (e + 1) * rate - 1;
    const bf16_t* k = kv + ((size_t)tables[(size_t)r * max_blocks + at / block] * block + at % block) * row_width + col;
    float dot[IDX_H];
    #pragma unroll
    for (int h = 0; h < IDX_H; ++h) dot[h] = 0.f;
    for (int d = 0; d < IDX_D; d += 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(k + d);
        const float k0 = __uint_as_float(v.x << 16), k1 = __uint_as_float(v.x & 0xffff0000u),
                    k2 = __uint_as_float(v.y << 16), k3 = __uint_as_float(v.y & 0xffff0000u);
        #pragma unroll
        for (int h = 0; h < IDX_H; ++h) {
            const float* qh = qs + h * IDX_D + d;
            dot[h] += qh[0] * k0 + qh[1] * k1 + qh[2] * k2 + qh[3] * k3;
        }
    }
    float s = 0.f;
    #pragma unroll
    for (int h = 0; h < IDX_H; ++h) s += ws[h] * fmaxf(dot[h], 0.f);
    scores[(size_t)r * stride + e] = s * scale;
}

// A score as an unsigned key in the same order (-0 as +0: the two are equal scores).
__device__ __forceinline__ unsigned order_key(float s) {
    const unsigned b = __float_as_uint(s == 0.f ? 0.f : s);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// The key of the topk-th largest of the row's n scores (n > topk), by four 8-bit radix passes over them, and
// *need: how many of the entries with exactly that key the top-k takes (the others' keys are larger).
__device__ unsigned threshold_key(const float* __restrict__ s, int n, int topk, int* need) {
    __shared__ int hist[256];
    __shared__ unsigned chosen;
    __shared__ int left;
    unsigned prefix = 0, mask = 0;
    int k = topk;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += TOPK_THREADS) hist[i] = 0;
        __syncthreads();
        for (int e = threadIdx.x; e < n; e += TOPK_THREADS) {
            const unsigned key = order_key(s[e]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {                         // the bin, from the top, where the count reaches k
            int above = 0, b = 255;
            for (; b > 0 && above + hist[b] < k; --b) above += hist[b];
            chosen = prefix | (unsigned)b << shift;
            left = k - above;
        }
        __syncthreads();
        prefix = chosen, k = left, mask |= 255u << shift;
    }
    *need = k;
    return prefix;
}

// indexer_topk: grid (rows), TOPK_THREADS threads. scores float32 [rows, stride] (indexer_scores'), positions
// int32 [rows]; ids int32 [rows, topk] ascending, -1 past counts[r] = min(n_r, topk).
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
indexer_topk(const float* __restrict__ scores, const int* __restrict__ positions, int* __restrict__ ids,
             int* __restrict__ counts, int stride, int rate, int topk) {
    pdl_begin();
    const int r = blockIdx.x, n = min(closed_entries(positions[r], rate), stride);
    const float* s = scores + (size_t)r * stride;
    int* out = ids + (size_t)r * topk;
    __shared__ int warp_sums[32];
    int need = n, written = 0, ties = 0;                // n <= topk: every entry, threshold key 0
    const unsigned threshold = n > topk ? threshold_key(s, n, topk, &need) : 0u;
    for (int base = 0; base < n && written < topk; base += TOPK_THREADS) {
        const int e = base + threadIdx.x;
        const unsigned key = e < n ? order_key(s[e]) : 0u;
        const bool eq = e < n && key == threshold, gt = e < n && key > threshold;
        int total;
        const int tie_rank = ties + block_exclusive_scan(eq, warp_sums, total);
        ties += total;
        const bool take = gt || (eq && tie_rank < need);
        const int at = written + block_exclusive_scan(take, warp_sums, total);
        if (take) out[at] = e;
        written += total;
    }
    for (int i = written + threadIdx.x; i < topk; i += TOPK_THREADS) out[i] = -1;
    if (threadIdx.x == 0) counts[r] = written;
}
