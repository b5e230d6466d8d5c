// Greedy pick and log-probabilities over fp32 logits rows [S, V], one block (1024 threads) per row:
//   argmax_logprob:  ids[r] = argmax_v x[r, v] (lowest index on ties, as numpy), lse[r] = logsumexp(x[r]),
//                    logprob[r] = x[r, ids[r]] − lse[r].
//   token_logprob:   x[r, ids[r]] − lse[r] for whatever token was finally chosen.
//   topk_logprobs:   the k best (value desc, index asc) of x[r] and their log-probabilities (k ≤ 20),
//                    k passes, each excluding what the previous ones took.
// Roofline: one (argmax) + one (logsumexp) read of V·4 bytes per row: 0.6 MB for a 152K vocab, ~0.15 µs
// of bandwidth, but one SM per row reads ~100-200 GB/s, so ~4 µs per row; rows run in parallel.
#include "common.cuh"

#define NT 1024

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {   // (v, i) ranks before (bv, bi)
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value desc, index asc); all threads get it.
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
    v = lane < NT / 32 ? sv[lane] : -INFINITY;
    i = lane < NT / 32 ? si[lane] : 0x7fffffff;
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
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) ids[r] = bi;
    if (lse_out == nullptr && logprob == nullptr) return;
    const float lse = row_logsumexp(x, V, bv, scratch);
    if (threadIdx.x == 0) {
        if (logprob != nullptr) logprob[r] = bv - lse;
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

// Needs lse from argmax_logprob (or any logsumexp of the same rows). out_* are [S, k].
extern "C" __global__ void __launch_bounds__(NT)
topk_logprobs(const float* __restrict__ logits, int V, int k, const float* __restrict__ lse,
              int* __restrict__ out_ids, float* __restrict__ out_logprobs) {
    pdl_begin();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* x = logits + (size_t)blockIdx.x * V;
    float pv = INFINITY; int pi = -1;                     // the previous pick
    for (int r = 0; r < k; ++r) {
        float bv = -INFINITY; int bi = 0x7fffffff;
        for (int v = threadIdx.x; v < V; v += NT) {
            const float xv = x[v];
            if (better(pv, pi, xv, v) && better(xv, v, bv, bi)) { bv = xv; bi = v; }
        }
        block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) {
            out_ids[blockIdx.x * k + r] = bi;
            out_logprobs[blockIdx.x * k + r] = bv - lse[blockIdx.x];
        }
        pv = bv; pi = bi;
    }
}
