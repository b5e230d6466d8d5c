// One token's MLA prologue (mla_latent_cache.cu; mla_absorb.cu's fused entry), by every thread of a block:
// y row = [q part (q_cols) | latent c (R) | rope key (Dr)]:
//   cache[slot] = [bf16(kv_norm · bf16(c · rstd(c))) | rotary(k_rope)]   (slot < 0: padding, no write)
//   q_out = bf16(q_norm · bf16(q · rstd(q)))  where q_norm is given (q_lora_rank set), else q as it is
// Rotary is interleaved (pairs (x[2i], x[2i+1]), transformers' DeepseekV2 apply_rotary_emb): angle_i =
// pos · inv_freq[i], cos and sin scaled by attn_factor (yarn mscale ratio); rounded to bf16 once.
// The cache row is bf16, or with FP8 (--kv-cache-dtype fp8, kv_fp8.cuh) the e4m3 bytes of those bf16 values
// divided by the layer's k_scale, saturated: R + Dr bytes a token.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

// bf16 RMSNorm of n values of src (stride 1) with weights w: store(i, w[i] · bf16(src[i] · rstd)) for each i;
// every thread of the block calls it.
template <typename Store>
__device__ __forceinline__ void block_rmsnorm(const bf16_t* __restrict__ src, const bf16_t* __restrict__ w, int n,
                                              float eps, float* scratch, Store store) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { const float f = bf16_to_f(src[i]); ss += f * f; }
    const float rstd = rsqrtf(block_sum(ss, scratch) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) store(i, bf16_to_f(w[i]) * round_bf16(bf16_to_f(src[i]) * rstd));
}

// Value i of a latent cache row: bf16(v), or (FP8) the e4m3 byte of bf16(v) / scale.
template <bool FP8>
__device__ __forceinline__ void store_latent(void* row, int i, float v, float scale) {
    if constexpr (FP8) static_cast<unsigned char*>(row)[i] = (unsigned char)(e4m3x2(round_bf16(v) / scale, 0.f) & 0xffu);
    else static_cast<bf16_t*>(row)[i] = f_to_bf16(v);
}

template <bool FP8>
__device__ __forceinline__ void mla_latent_row(const bf16_t* __restrict__ row, int q_cols, int R, int Dr,
                                               const bf16_t* __restrict__ kv_norm, const bf16_t* __restrict__ q_norm,
                                               float eps, const float* __restrict__ inv_freq, float attn_factor,
                                               float pos, int slot, void* __restrict__ cache, float scale,
                                               bf16_t* __restrict__ q_dst, float* scratch) {
    if (q_norm != nullptr) {
        block_rmsnorm(row, q_norm, q_cols, eps, scratch, [&](int i, float v) { q_dst[i] = f_to_bf16(v); });
    } else {
        for (int i = threadIdx.x; i < q_cols; i += blockDim.x) q_dst[i] = row[i];
    }
    if (slot < 0) return;                              // uniform over the block
    void* dst = static_cast<unsigned char*>(cache) + (size_t)slot * (R + Dr) * (FP8 ? 1 : 2);
    block_rmsnorm(row + q_cols, kv_norm, R, eps, scratch, [&](int i, float v) { store_latent<FP8>(dst, i, v, scale); });
    const bf16_t* k = row + q_cols + R;
    for (int i = threadIdx.x; i < Dr / 2; i += blockDim.x) {
        const float a = bf16_to_f(k[2 * i]), b = bf16_to_f(k[2 * i + 1]);
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        s *= attn_factor; c *= attn_factor;
        store_latent<FP8>(dst, R + 2 * i, a * c - b * s, scale);
        store_latent<FP8>(dst, R + 2 * i + 1, a * s + b * c, scale);
    }
}
