// Prompt-lookup drafts on the device (engine/ngram.py ngram_draft defines them; engine/executor/gpu_ngram.py
// keeps the ids). Each sequence's ids so far (prompt and output) are a row of `tokens` ([rows, row_stride]
// int32: one row per sequence slot, written at admission and appended in place each step, so a step adds a few
// ids and nothing moves; a ragged layout would need compaction as sequences come and go).
//
// ngram_draft: one CTA per sequence b of the batch (its row rows[b], its length lengths[b]). For every earlier
// position p < last (last = lengths[b] - 1) the match length m(p) = how many ids ending at p equal those ending
// at last, counted back and capped at max_n; the longest m over p, taken if >= min_n, and of the positions with
// that m the first: the draft is the (at most limits[b] <= k) ids after it, fewer where the row ends sooner.
// drafts[b, :counts[b]] get them (counts[b] = 0: no draft). That is ngram_draft's result: its earliest
// occurrence of the longest suffix n-gram min_n <= n <= max_n that occurs earlier. Cost per sequence: one
// coalesced read of its row (the compare with the last id), a walk back of at most max_n - 1 reads from each
// position that matched it, a block reduction, then k reads; O(length) work over the CTA's threads.
//
// ngram_append: one thread per sequence b of a step, writing its emitted ids to its row from position at[b]:
// ids[row_start[b] .. row_start[b] + accepted[b]] (the accepted drafts and the token after them, as
// spec_accept.cu lays them out; a plain decode: row_start = b, accepted 0), clipped to the row, and its new
// length to lengths[b] (what ngram_draft then reads); rows[b] < 0: a sequence without a row, skipped.
#include "common.cuh"

#ifndef NGRAM_THREADS
#define NGRAM_THREADS 256         // the launch's block (gpu_ngram.py DRAFT_THREADS), a multiple of 32
#endif
#define NGRAM_WARPS (NGRAM_THREADS / 32)

// a beats b: a longer match, or as long and earlier
__device__ __forceinline__ bool ngram_better(int am, int ap, int bm, int bp) {
    return am > bm || (am == bm && ap < bp);
}

extern "C" __global__ void __launch_bounds__(NGRAM_THREADS)
ngram_draft(const int* __restrict__ tokens, long long row_stride, const int* __restrict__ rows,
            const int* __restrict__ lengths, const int* __restrict__ limits, int min_n, int max_n, int k,
            int* __restrict__ drafts, int* __restrict__ counts) {
    pdl_begin();
    __shared__ int warp_m[NGRAM_WARPS], warp_p[NGRAM_WARPS];
    __shared__ int found_m, found_p;
    const int b = blockIdx.x, tid = threadIdx.x;
    const int length = lengths[b], last = length - 1, limit = min(limits[b], k);
    if (limit <= 0 || last < min_n) {             // an n-gram and an earlier occurrence need n + 1 ids
        if (tid == 0) counts[b] = 0;
        return;
    }
    const int* t = tokens + rows[b] * row_stride;
    const int tail = t[last];
    int best_m = 0, best_p = last;                // p ascends per thread: the first of equal matches stays
    for (int p = tid; p < last; p += NGRAM_THREADS) {
        if (t[p] != tail) continue;
        int m = 1;
        while (m < max_n && m <= p && t[p - m] == t[last - m]) ++m;
        if (m > best_m) best_m = m, best_p = p;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const int m = __shfl_xor_sync(0xffffffffu, best_m, o), p = __shfl_xor_sync(0xffffffffu, best_p, o);
        if (ngram_better(m, p, best_m, best_p)) best_m = m, best_p = p;
    }
    if (tid % 32 == 0) warp_m[tid / 32] = best_m, warp_p[tid / 32] = best_p;
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < NGRAM_WARPS; ++w)
            if (ngram_better(warp_m[w], warp_p[w], best_m, best_p)) best_m = warp_m[w], best_p = warp_p[w];
        found_m = best_m, found_p = best_p;
    }
    __syncthreads();
    const int start = found_p + 1, n = found_m >= min_n ? min(limit, length - start) : 0;
    for (int j = tid; j < n; j += NGRAM_THREADS) drafts[(long long)b * k + j] = t[start + j];
    if (tid == 0) counts[b] = n;
}

extern "C" __global__ void ngram_append(int* __restrict__ tokens, long long row_stride, const int* __restrict__ rows,
                                        const int* __restrict__ at, const int* __restrict__ ids,
                                        const int* __restrict__ row_start, const int* __restrict__ accepted,
                                        int seqs, int* __restrict__ lengths) {
    pdl_begin();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= seqs || rows[b] < 0) return;
    int* row = tokens + rows[b] * row_stride;
    const int first = row_start[b], n = min(accepted[b] + 1, (int)(row_stride - at[b]));
    for (int j = 0; j < n; ++j) row[at[b] + j] = ids[first + j];
    lengths[b] = at[b] + n;
}
