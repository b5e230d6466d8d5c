// paged_decode.cu's fused prologue (rope_paged_decode_attention and its _lora twin), included by it after its shape
// macros (GQA, HEAD_DIM, HEADS, WARPS, NTHREADS): a CTA's query heads of the step's qkv row normed and roped into
// shared memory, the owning split's key and value built and written to the cache, and with LoRA the row's
// adapter delta staged first. Same bits as qk_norm_rope_cache.cu (rope.cuh's functions for both).
#pragma once
#include "rope.cuh"      // norm_rope_piece, norm_rope_head, rope_angle (and common.cuh)

// The fused entry's prologue inputs (rope_paged_decode_attention); the plain entry passes none.
struct RopeArgs {
    const bf16_t* qkv;            // [T, (Hq + 2·Hkv)·D]: the qkv projection's rows
    const bf16_t* q_norm_w;       // [D] or null
    const bf16_t* k_norm_w;       // [D] or null
    float eps;
    const float* inv_freq;        // [D/2]
    float attn_factor;
    const int* slot_mapping;      // [T]: the KV slot of the step's own key (< 0: padding, not written)
    int row_stride;               // values between two qkv rows ((Hq + 2·Hkv)·D, or the LoRA product's width)
    // LoRA (the _lora entry): row t's slot lora_slots[t] (-1: none) adds h · B[slot, column]ᵀ to each
    // column before the norms, h its slot's shrink in the row's columns lora_n + slot · 3·LORA_R (q, k, v)
    const int* lora_slots;        // [T] or null
    const bf16_t* lora_b;         // [slots, lora_n, LORA_R] bf16, lora_alpha / r folded in
    int lora_n;                   // (Hq + 2·Hkv)·D: the projection's columns
};

#ifndef LORA_R                                          // the _lora entry's (padded) rank: defined where it is built
#define LORA_R 8
#define NO_LORA_ENTRY
#endif
#define LORA_ROWS (HEADS + 2)                            // a CTA's staged rows: its query heads, then k and v

// The qkv column of a CTA's staged row j: query head head0 + j (j < HEADS), its k (HEADS), its v (HEADS + 1).
__device__ __forceinline__ int staged_head(int j, int head0, int kvh, int num_heads, int num_kv_heads) {
    return j < HEADS ? head0 + j : j == HEADS ? num_heads + kvh : num_heads + num_kv_heads + kvh;
}

// LoRA: the CTA's rows of the qkv row with the slot's delta, bf16(y + h · B[slot, column]ᵀ) (rank order,
// as lora_expand.cu's compacting epilogue), into lora_s; h (the q, k and v slices' shrink) via h_s. A thread's
// B rows of BATCH elements go out together (one L2 round trip for them, not one an element).
__device__ __forceinline__ void lora_stage(const RopeArgs& r, const bf16_t* row, int slot, int rows, int head0,
                                           int kvh, int num_heads, int num_kv_heads, bf16_t (*lora_s)[HEAD_DIM],
                                           float* h_s) {
    constexpr int Q = LORA_R / 8;
    constexpr int BATCH = Q >= 8 ? 1 : 8 / Q;      // elements whose B rows are in flight together (8 uint4 a thread)
    const int total = rows * HEAD_DIM;
    for (int j = threadIdx.x; j < 3 * LORA_R; j += NTHREADS) h_s[j] = bf16_to_f(row[r.lora_n + slot * 3 * LORA_R + j]);
    __syncthreads();
    for (int e0 = threadIdx.x; e0 < total; e0 += BATCH * NTHREADS) {
        uint4 bv[BATCH][Q];
        float y[BATCH];
        #pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int e = e0 + k * NTHREADS;
            if (e < total) {
                const int col = staged_head(e / HEAD_DIM, head0, kvh, num_heads, num_kv_heads) * HEAD_DIM + e % HEAD_DIM;
                const uint4* b = reinterpret_cast<const uint4*>(r.lora_b + ((size_t)slot * r.lora_n + col) * LORA_R);
                #pragma unroll
                for (int q = 0; q < Q; ++q) bv[k][q] = __ldg(b + q);
                y[k] = bf16_to_f(row[col]);
            }
        }
        #pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int e = e0 + k * NTHREADS, j = e / HEAD_DIM;
            if (e < total) {
                const float* h = h_s + (j < HEADS ? 0 : j - HEADS + 1) * LORA_R;
                float acc = 0.f;
                #pragma unroll
                for (int q = 0; q < Q; ++q) {
                    const bf16_t* bs = reinterpret_cast<const bf16_t*>(&bv[k][q]);
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc += h[q * 8 + i] * bf16_to_f(bs[i]);
                }
                lora_s[j][e % HEAD_DIM] = f_to_bf16(y[k] + acc);
            }
        }
    }
    __syncthreads();
}

// Fused prologue (one step = one query token per sequence): the CTA's HEADS query heads (from head0),
// normed and roped from the qkv row into q_s; the split that holds position ctx − 1 (the step's own
// key) also builds that key and value into kv_s, and its first head group's CTA (writer) writes them to
// the cache at slot_mapping[t] (the other groups' CTAs of that split take them from kv_s too, never
// from the cache). Returns the position whose key and value come from kv_s (-1 for the other splits).
// LORA: a row with an adapter is first staged with its delta (lora_stage) and normed from there.
template <bool LORA>
__device__ __forceinline__ int rope_prologue(const RopeArgs& r, int t, int kvh, int head0, int num_kv_heads,
                                             int ctx, bool owner, bool writer, bf16_t (*q_s)[HEAD_DIM],
                                             bf16_t (*kv_s)[HEAD_DIM], bf16_t* k_cache, bf16_t* v_cache,
                                             int lora_slot, bf16_t (*lora_s)[HEAD_DIM], float* h_s) {
    const int num_heads = num_kv_heads * GQA, warp = threadIdx.x >> 5;
    const bf16_t* row = r.qkv + (size_t)t * r.row_stride;
    const float pos = (float)(ctx - 1);
    const bool staged = LORA && lora_slot >= 0;          // CTA-uniform
    if (staged)
        lora_stage(r, row, lora_slot, HEADS + (owner ? 2 : 0), head0, kvh, num_heads, num_kv_heads, lora_s, h_s);
    auto src = [&](int j) -> const bf16_t* {
        return staged ? lora_s[j] : row + (size_t)staged_head(j, head0, kvh, num_heads, num_kv_heads) * HEAD_DIM;
    };
    constexpr int LANES = rope_piece_lanes(HEAD_DIM);
    const int rows = HEADS + (owner ? 1 : 0);            // the query heads, then the key (CTA-uniform)
    if constexpr (LANES > 0) {                           // qk_norm_rope_cache.cu's pieces: the same bits
        __shared__ float cos_s[HEAD_DIM / 2], sin_s[HEAD_DIM / 2];
        for (int i = threadIdx.x; i < HEAD_DIM / 2; i += NTHREADS)
            rope_angle(r.inv_freq, r.attn_factor, pos, i, cos_s[i], sin_s[i]);
        __syncthreads();
        constexpr int L = LANES > 0 ? LANES : 1, PER_WARP = 32 / L;   // L: no division by zero where unused
        const int lane = threadIdx.x & 31, e0 = 8 * (lane % L);
        for (int j0 = warp * PER_WARP; j0 < rows; j0 += WARPS * PER_WARP) {
            const int j = j0 + lane / L;
            const bool live = j < rows;
            const uint4 x = live ? *reinterpret_cast<const uint4*>(src(j) + e0) : kZero16;
            const uint4 out = norm_rope_piece<L>(x, j < HEADS ? r.q_norm_w : r.k_norm_w, live, r.eps,
                                                 [&](int i, float& c, float& s) { c = cos_s[i]; s = sin_s[i]; });
            if (live) *reinterpret_cast<uint4*>((j < HEADS ? q_s[j] : kv_s[0]) + e0) = out;
        }
    } else {
        for (int j = warp; j < rows; j += WARPS) {
            if (j < HEADS)
                norm_rope_head(src(j), q_s[j], r.q_norm_w, r.eps, r.inv_freq, r.attn_factor, pos, HEAD_DIM);
            else
                norm_rope_head(src(HEADS), kv_s[0], r.k_norm_w, r.eps, r.inv_freq, r.attn_factor, pos, HEAD_DIM);
        }
    }
    const bf16_t* v_row = src(HEADS + 1);
    if (owner)
        for (int i = threadIdx.x; i < HEAD_DIM; i += NTHREADS) kv_s[1][i] = v_row[i];
    __syncthreads();
    if (!owner) return -1;
    const int slot = r.slot_mapping[t];
    if (slot >= 0 && writer) {                              // one head group's CTA writes the key
        const size_t off = ((size_t)slot * num_kv_heads + kvh) * HEAD_DIM;
        for (int i = threadIdx.x; i < HEAD_DIM; i += NTHREADS) {
            k_cache[off + i] = kv_s[0][i];
            v_cache[off + i] = kv_s[1][i];
        }
    }
    return ctx - 1;
}
