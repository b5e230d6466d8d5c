// MLA in the expanded form (DeepSeek-V2 prefill): K and V built from the latent cache so that
// paged_attention.cu attends over them as plain multi-head attention (head dim Dk = nope + rope, V
// zero-padded from v to Dk). The expansion rows are laid out per sequence in whole 16-token blocks;
// src_slots[r] is the cache slot of row r (-1: a padding row).
//   mla_gather_latent: latent[r] = cache[src_slots[r], :R]                          (zeros for padding)
//   (the caller multiplies latent · kv_bᵀ into kv[r, h, :nope + v])
//   mla_expand_kv:     k[r, h] = [kv[r, h, :nope] | cache[src_slots[r], R:R + Dr]],
//                      v[r, h] = [kv[r, h, nope:] | 0 ...]                           (Dk values each)
//   mla_q_rope:        q_out[t, h] = [q[t, h, :nope] | rotary(q[t, h, nope:])]  (interleaved pairs, cos /
//                      sin · attn_factor, rounded to bf16 once, as mla_latent_cache.cu rotates the key)
//   mla_compact_o:     o[t, h, :v] = o_full[t, h, :v]
// Roofline: the expansion writes 2·rows·H·Dk·2 bytes and reads rows·H·(nope + v)·2 (V2-Lite, 4K rows:
// 100 MB written, 64 MB read, ~40 µs per layer at 4.3 TB/s): a cost the tensor-core GEMM before it and
// the attention after it (O(n²)) dominate for long prompts.
// With --kv-cache-dtype fp8 the _fp8 entries read the e4m3 cache (mla_latent_cache_fp8) as bf16(e4m3 · scale).
#include "kv_fp8.cuh"      // KVElem, e4m3x2_to_floats

// Value i of a cache of format FP8 as bf16 (e4m3 · scale, rounded once).
template <bool FP8>
__device__ __forceinline__ bf16_t latent_value(const typename KVElem<FP8>::type* cache, size_t i, float scale) {
    if constexpr (FP8) {
        float v, unused;
        e4m3x2_to_floats((unsigned short)cache[i], v, unused);
        return f_to_bf16(v * scale);
    } else {
        return cache[i];
    }
}

template <bool FP8>
__device__ __forceinline__ void gather_latent(const typename KVElem<FP8>::type* __restrict__ cache,
                                              const int* __restrict__ src_slots, bf16_t* __restrict__ latent, int R,
                                              int row, float scale) {
    pdl_begin();
    const int slot = src_slots[blockIdx.x];
    bf16_t* dst = latent + (size_t)blockIdx.x * R;
    for (int i = threadIdx.x; i < R; i += blockDim.x)
        dst[i] = slot >= 0 ? latent_value<FP8>(cache, (size_t)slot * row + i, scale) : (bf16_t)0;
}

extern "C" __global__ void mla_gather_latent(const bf16_t* __restrict__ cache, const int* __restrict__ src_slots,
                                             bf16_t* __restrict__ latent, int R, int row) {
    gather_latent<false>(cache, src_slots, latent, R, row, 1.f);
}

extern "C" __global__ void mla_gather_latent_fp8(const unsigned char* __restrict__ cache,
                                                 const int* __restrict__ src_slots, bf16_t* __restrict__ latent,
                                                 int R, int row, float scale) {
    gather_latent<true>(cache, src_slots, latent, R, row, scale);
}

template <bool FP8>
__device__ __forceinline__ void expand_kv(const bf16_t* __restrict__ kv, const typename KVElem<FP8>::type* __restrict__ cache,
                                          const int* __restrict__ src_slots, bf16_t* __restrict__ k_out,
                                          bf16_t* __restrict__ v_out, int H, int nope, int vd, int Dr, int R,
                                          float scale) {
    pdl_begin();
    const size_t r = blockIdx.x;
    const int slot = src_slots[r], Dk = nope + Dr;
    const bf16_t* kvr = kv + r * H * (nope + vd);
    const size_t rope = (size_t)max(slot, 0) * (R + Dr) + R;
    for (int i = threadIdx.x; i < H * Dk; i += blockDim.x) {
        const int h = i / Dk, d = i % Dk;
        bf16_t k = 0, v = 0;
        if (slot >= 0) {
            k = d < nope ? kvr[h * (nope + vd) + d] : latent_value<FP8>(cache, rope + d - nope, scale);
            v = d < vd ? kvr[h * (nope + vd) + nope + d] : (bf16_t)0;
        }
        k_out[r * H * Dk + i] = k;
        v_out[r * H * Dk + i] = v;
    }
}

extern "C" __global__ void mla_expand_kv(const bf16_t* __restrict__ kv, const bf16_t* __restrict__ cache,
                                         const int* __restrict__ src_slots, bf16_t* __restrict__ k_out,
                                         bf16_t* __restrict__ v_out, int H, int nope, int vd, int Dr, int R) {
    expand_kv<false>(kv, cache, src_slots, k_out, v_out, H, nope, vd, Dr, R, 1.f);
}

extern "C" __global__ void mla_expand_kv_fp8(const bf16_t* __restrict__ kv, const unsigned char* __restrict__ cache,
                                             const int* __restrict__ src_slots, bf16_t* __restrict__ k_out,
                                             bf16_t* __restrict__ v_out, int H, int nope, int vd, int Dr, int R,
                                             float scale) {
    expand_kv<true>(kv, cache, src_slots, k_out, v_out, H, nope, vd, Dr, R, scale);
}

extern "C" __global__ void mla_q_rope(const bf16_t* __restrict__ q, const float* __restrict__ inv_freq,
                                      float attn_factor, const int* __restrict__ positions,
                                      bf16_t* __restrict__ q_out, int H, int nope, int Dr) {
    pdl_begin();
    const size_t t = blockIdx.x;
    const int Dk = nope + Dr;
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < H * Dk; i += blockDim.x) {
        const int d = i % Dk;
        const bf16_t* src = q + t * H * Dk + (i - d);
        if (d < nope) { q_out[t * H * Dk + i] = src[d]; continue; }
        const int j = (d - nope) >> 1;
        const float a = bf16_to_f(src[nope + 2 * j]), b = bf16_to_f(src[nope + 2 * j + 1]);
        float s, c;
        sincosf(pos * inv_freq[j], &s, &c);
        s *= attn_factor; c *= attn_factor;
        q_out[t * H * Dk + i] = f_to_bf16(((d - nope) & 1) ? a * s + b * c : a * c - b * s);
    }
}

extern "C" __global__ void mla_compact_o(const bf16_t* __restrict__ o_full, bf16_t* __restrict__ o, int H, int Dk,
                                         int vd) {
    pdl_begin();
    const size_t t = blockIdx.x;
    for (int i = threadIdx.x; i < H * vd; i += blockDim.x) o[t * H * vd + i] = o_full[t * H * Dk + (i / vd) * Dk + i % vd];
}
