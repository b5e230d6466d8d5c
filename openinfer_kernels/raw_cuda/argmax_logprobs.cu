// Greedy pick and log-probabilities over fp32 logits rows [S, V], one block (1024 threads) per row:
//   argmax_logprob:  ids[r] = argmax_v x[r, v] (lowest index on ties, as numpy), lse[r] = logsumexp(x[r]),
//                    logprob[r] = x[r, ids[r]] − lse[r]; argmax_logprob_split the same for a few rows,
//                    each over several CTAs (below).
//   token_logprob:   x[r, ids[r]] − lse[r] for whatever token was finally chosen.
//   topk_logprobs:   the k best (value desc, index asc) of x[r] and their log-probabilities (k ≤ 20),
//                    k passes, each excluding what the previous ones took; topk_logprobs_each takes
//                    a per-row k from device memory (decode graphs fill it before each replay).
// Roofline: one (argmax) + one (logsumexp) read of V·4 bytes per row: 0.6 MB for a 152K vocab, ~0.15 µs
// of bandwidth, but one SM per row reads ~100-200 GB/s, so ~4 µs per row; rows run in parallel.
#include "common.cuh"

#define NT 1024

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {   // (v, i) ranks before (bv, bi)
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value desc, index asc) over THREADS threads; all threads get it.
template <int THREADS>
__device__ __forceinline__ void block_best(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < THREADS / 32 ? sv[lane] : -INFINITY;
    i = lane < THREADS / 32 ? si[lane] : 0x7fffffff;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

__device__ float row_logsumexp(const float* x, int V, float m, float* scratch) {
    float s = 0.f;
    for (int v = threadIdx.x; v < V; v += NT) s += expf(x[v] - m);
    return m + logf(block_sum(s, scratch));
}

// Row r = rows[blockIdx.x] (rows may be null: r = blockIdx.x); logprob and lse_out may be null.
extern "C" __global__ void __launch_bounds__(NT)
argmax_logprob(const float* __restrict__ logits, int V, const int* __restrict__ rows, int* __restrict__ ids,
               float* __restrict__ logprob, float* __restrict__ lse_out) {
    pdl_begin();
    __shared__ float sv[32], scratch[33];
    __shared__ int si[32];
    const int r = rows != nullptr ? rows[blockIdx.x] : blockIdx.x;
    const float* x = logits + (size_t)r * V;
    float bv = -INFINITY; int bi = 0x7fffffff;
    for (int v = threadIdx.x; v < V; v += NT) if (better(x[v], v, bv, bi)) { bv = x[v]; bi = v; }
    block_best<NT>(bv, bi, sv, si);
    if (threadIdx.x == 0) ids[r] = bi;
    if (lse_out == nullptr && logprob == nullptr) return;
    const float lse = row_logsumexp(x, V, bv, scratch);
    if (threadIdx.x == 0) {
        if (logprob != nullptr) logprob[r] = bv - lse;
        if (lse_out != nullptr) lse_out[r] = lse;
    }
}

// argmax_logprob for a few rows, with gridDim.x CTAs per row (one CTA scans a 152K row at ~25 µs;
// chunks of a few thousand logits take a few µs). CTA (c, r) finds the best (value, index) of the c-th
// chunk of row r and the sum of exp(x - that best) over the chunk; the last CTA of the row to finish
// (a ticket counter it resets, so graph replays find it at 0) merges them: the same id as
// argmax_logprob (lowest index on ties), the logsumexp up to float rounding of the summation order.
// part_v / part_i / part_s hold [rows, gridDim.x] partials; tickets [rows] start at zero.
#define SPLIT_NT 256
extern "C" __global__ void __launch_bounds__(SPLIT_NT)
argmax_logprob_split(const float* __restrict__ logits, int V, int* __restrict__ ids, float* __restrict__ logprob,
                     float* __restrict__ lse_out, float* __restrict__ part_v, int* __restrict__ part_i,
                     float* __restrict__ part_s, unsigned* __restrict__ tickets) {
    pdl_begin();
    __shared__ float sv[32], scratch[33];
    __shared__ int si[32];
    __shared__ bool last;
    const int r = blockIdx.y, c = blockIdx.x, C = gridDim.x, tid = threadIdx.x;
    const float* x = logits + (size_t)r * V;
    const int chunk = (V + C - 1) / C, lo = min(V, c * chunk), hi = min(V, lo + chunk);
    float bv = -INFINITY; int bi = 0x7fffffff;
    for (int v = lo + tid; v < hi; v += SPLIT_NT) if (better(x[v], v, bv, bi)) { bv = x[v]; bi = v; }
    block_best<SPLIT_NT>(bv, bi, sv, si);
    float s = 0.f;
    if (bv != -INFINITY) for (int v = lo + tid; v < hi; v += SPLIT_NT) s += expf(x[v] - bv);
    s = block_sum(s, scratch);
    if (tid == 0) {
        part_v[r * C + c] = bv; part_i[r * C + c] = bi; part_s[r * C + c] = s;
        __threadfence();
        last = atomicAdd(&tickets[r], 1u) == (unsigned)(C - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float mv = -INFINITY, ms = 0.f; int mi = 0x7fffffff;
    if (tid < C) { mv = __ldcg(part_v + r * C + tid); mi = __ldcg(part_i + r * C + tid); ms = __ldcg(part_s + r * C + tid); }
    float m = mv; int mbest = mi;
    block_best<SPLIT_NT>(m, mbest, sv, si);
    const float total = block_sum(mv == -INFINITY ? 0.f : ms * expf(mv - m), scratch);
    if (tid == 0) {
        tickets[r] = 0u;
        ids[r] = mbest;
        const float lse = m + logf(total);
        if (logprob != nullptr) logprob[r] = m - lse;
        if (lse_out != nullptr) lse_out[r] = lse;
    }
}

// out[i] = logits[i, ids[i]] - lse[i]: the log-probability of the token finally chosen.
extern "C" __global__ void token_logprob(const float* __restrict__ logits, int V, const int* __restrict__ ids,
                                         const float* __restrict__ lse, float* __restrict__ out, int n) {
    pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = logits[(size_t)i * V + ids[i]] - lse[i];
}

// The k best of row x (value desc, index asc) and their log-probabilities x - lse into out_*[0, k).
__device__ void topk_row(const float* x, int V, int k, float lse, int* out_ids, float* out_logprobs) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float pv = INFINITY; int pi = -1;                     // the previous pick
    for (int r = 0; r < k; ++r) {
        float bv = -INFINITY; int bi = 0x7fffffff;
        for (int v = threadIdx.x; v < V; v += NT) {
            const float xv = x[v];
            if (better(pv, pi, xv, v) && better(xv, v, bv, bi)) { bv = xv; bi = v; }
        }
        block_best<NT>(bv, bi, sv, si);
        if (threadIdx.x == 0) { out_ids[r] = bi; out_logprobs[r] = bv - lse; }
        pv = bv; pi = bi;
    }
}

// Needs lse from argmax_logprob (or any logsumexp of the same rows). out_* are [S, k].
extern "C" __global__ void __launch_bounds__(NT)
topk_logprobs(const float* __restrict__ logits, int V, int k, const float* __restrict__ lse,
              int* __restrict__ out_ids, float* __restrict__ out_logprobs) {
    pdl_begin();
    const size_t b = blockIdx.x;
    topk_row(logits + b * V, V, k, lse[b], out_ids + b * k, out_logprobs + b * k);
}

// As topk_logprobs with a per-row count: row b takes min(ks[b], stride) picks into out_*[b, 0..)
// (rows of `stride`); ks[b] <= 0 (no logprobs asked, a padded graph row) does nothing.
extern "C" __global__ void __launch_bounds__(NT)
topk_logprobs_each(const float* __restrict__ logits, int V, int stride, const int* __restrict__ ks,
                   const float* __restrict__ lse, int* __restrict__ out_ids, float* __restrict__ out_logprobs) {
    pdl_begin();
    const size_t b = blockIdx.x;
    const int k = min(ks[b], stride);
    if (k <= 0) return;
    topk_row(logits + b * V, V, k, lse[b], out_ids + b * stride, out_logprobs + b * stride);
}
