// MLA prologue (DeepSeek-V2), one CTA per token t of the fused down-projection row
// y[t] = [q part (q_cols) | latent c (R) | rope key (Dr)]:
//   cache[slot[t]] = [bf16(kv_norm · bf16(c · rstd(c))) | rotary(k_rope)]   (slot < 0: padding, no write)
//   q_out[t] = bf16(q_norm · bf16(q · rstd(q)))  where q_norm is given (q_lora_rank set), else q as it is
// Rotary is interleaved (pairs (x[2i], x[2i+1]), transformers' DeepseekV2 apply_rotary_emb): angle_i =
// pos[t] · inv_freq[i], cos and sin scaled by attn_factor (yarn mscale ratio); rounded to bf16 once.
// The paged cache of an MLA layer is one plane of one head: R + Dr values per token (576 on V2-Lite).
// Roofline: reads and writes (q_cols + R + Dr)·2 bytes per token (V2-Lite: 3.2 KB read, 3.2 KB
// written); launch-bound at decode, ~1 µs per 1K tokens of prefill.
#include "common.cuh"

#define THREADS 128

// bf16 RMSNorm of n values of src into dst (strides 1), with weights w; every thread of the block calls it.
__device__ __forceinline__ void block_rmsnorm(const bf16_t* __restrict__ src, bf16_t* __restrict__ dst,
                                              const bf16_t* __restrict__ w, int n, float eps, float* scratch) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += THREADS) { const float f = bf16_to_f(src[i]); ss += f * f; }
    const float rstd = rsqrtf(block_sum(ss, scratch) / n + eps);
    for (int i = threadIdx.x; i < n; i += THREADS)
        dst[i] = f_to_bf16(bf16_to_f(w[i]) * round_bf16(bf16_to_f(src[i]) * rstd));
}

extern "C" __global__ void __launch_bounds__(THREADS)
mla_latent_cache(const bf16_t* __restrict__ y, int q_cols, int R, int Dr, const bf16_t* __restrict__ kv_norm,
                 const bf16_t* __restrict__ q_norm, float eps, const float* __restrict__ inv_freq, float attn_factor,
                 const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                 bf16_t* __restrict__ cache, bf16_t* __restrict__ q_out) {
    pdl_begin();
    __shared__ float scratch[33];
    const size_t t = blockIdx.x;
    const bf16_t* row = y + t * (q_cols + R + Dr);
    bf16_t* q_dst = q_out + t * q_cols;
    if (q_norm != nullptr) {
        block_rmsnorm(row, q_dst, q_norm, q_cols, eps, scratch);
    } else {
        for (int i = threadIdx.x; i < q_cols; i += THREADS) q_dst[i] = row[i];
    }
    const int slot = slot_mapping[t];
    if (slot < 0) return;                              // uniform over the block
    bf16_t* dst = cache + (size_t)slot * (R + Dr);
    block_rmsnorm(row + q_cols, dst, kv_norm, R, eps, scratch);
    const float pos = (float)positions[t];
    const bf16_t* k = row + q_cols + R;
    for (int i = threadIdx.x; i < Dr / 2; i += THREADS) {
        const float a = bf16_to_f(k[2 * i]), b = bf16_to_f(k[2 * i + 1]);
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        s *= attn_factor; c *= attn_factor;
        dst[R + 2 * i] = f_to_bf16(a * c - b * s);
        dst[R + 2 * i + 1] = f_to_bf16(a * s + b * c);
    }
}
