// One token's MLA prologue (mla_latent_cache.cu; mla_absorb.cu's fused entry), by every thread of a block:
// y row = [q part (q_cols) | latent c (R) | rope key (Dr)]:
//   cache[slot] = [bf16(kv_norm · bf16(c · rstd(c))) | rotary(k_rope)]   (slot < 0: padding, no write)
//   q_out = bf16(q_norm · bf16(q · rstd(q)))  where q_norm is given (q_lora_rank set), else q as it is
// Rotary is interleaved (pairs (x[2i], x[2i+1]), transformers' DeepseekV2 apply_rotary_emb): angle_i =
// pos · inv_freq[i], cos and sin scaled by attn_factor (yarn mscale ratio); rounded to bf16 once.
#pragma once
#include "common.cuh"

// bf16 RMSNorm of n values of src into dst (strides 1), with weights w; every thread of the block calls it.
__device__ __forceinline__ void block_rmsnorm(const bf16_t* __restrict__ src, bf16_t* __restrict__ dst,
                                              const bf16_t* __restrict__ w, int n, float eps, float* scratch) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { const float f = bf16_to_f(src[i]); ss += f * f; }
    const float rstd = rsqrtf(block_sum(ss, scratch) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        dst[i] = f_to_bf16(bf16_to_f(w[i]) * round_bf16(bf16_to_f(src[i]) * rstd));
}

__device__ __forceinline__ void mla_latent_row(const bf16_t* __restrict__ row, int q_cols, int R, int Dr,
                                               const bf16_t* __restrict__ kv_norm, const bf16_t* __restrict__ q_norm,
                                               float eps, const float* __restrict__ inv_freq, float attn_factor,
                                               float pos, int slot, bf16_t* __restrict__ cache,
                                               bf16_t* __restrict__ q_dst, float* scratch) {
    if (q_norm != nullptr) {
        block_rmsnorm(row, q_dst, q_norm, q_cols, eps, scratch);
    } else {
        for (int i = threadIdx.x; i < q_cols; i += blockDim.x) q_dst[i] = row[i];
    }
    if (slot < 0) return;                              // uniform over the block
    bf16_t* dst = cache + (size_t)slot * (R + Dr);
    block_rmsnorm(row + q_cols, dst, kv_norm, R, eps, scratch);
    const bf16_t* k = row + q_cols + R;
    for (int i = threadIdx.x; i < Dr / 2; i += blockDim.x) {
        const float a = bf16_to_f(k[2 * i]), b = bf16_to_f(k[2 * i + 1]);
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        s *= attn_factor; c *= attn_factor;
        dst[R + 2 * i] = f_to_bf16(a * c - b * s);
        dst[R + 2 * i + 1] = f_to_bf16(a * s + b * c);
    }
}
