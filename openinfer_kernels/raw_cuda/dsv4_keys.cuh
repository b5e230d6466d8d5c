// DeepSeek-V4's attention keys of one query row (dsv4_attention.cu's sparse_decode, dsv4_sparse_mma.cu's
// sparse_prefill): row t at position p sees `window` keys of its sliding window, then its compressed entries
// (rate > 0): the indexer's ids[0 .. topk) (CSA; -1: none) or every closed entry e < (p + 1) / rate (HCA).
#pragma once

// The position of key j of row t (-1: none): the window's first, then the entries' rows (entry e sits in the row
// of its window's last token, position (e + 1) · rate - 1).
__device__ __forceinline__ int key_position(int j, int p, const int* __restrict__ ids, int window, int rate,
                                            int topk) {
    if (j < window) {
        const int at = p - window + 1 + j;
        return at >= 0 ? at : -1;
    }
    const int e = topk ? ids[j - window] : j - window;
    return e >= 0 ? (e + 1) * rate - 1 : -1;
}

// The slot of key position `at` through the row's block table (-1 stays -1).
__device__ __forceinline__ int key_slot(int at, const int* __restrict__ table, int block) {
    return at < 0 ? -1 : table[at / block] * block + at % block;
}
