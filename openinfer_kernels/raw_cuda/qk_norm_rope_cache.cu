// Attention prologue for one step, grid (T, head groups), one warp per head:
//   q, k, v = split(qkv[t]);  q, k = per-head RMSNorm(q, k) (Qwen3, when weights are given);
//   q, k = rotary(q, k) neox style: angle_i = pos[t] · inv_freq[i], pairs (i, i + D/2), cos and sin
//          scaled by attn_factor (yarn; 1 otherwise);
//   q_out[t] = q;  k_cache[slot[t]] = k;  v_cache[slot[t]] = v   (slot < 0: padding, not written).
// Rounding follows the bf16 reference: normed values and rotated values are rounded to bf16 once each.
// Roofline: reads (Hq + 2·Hkv)·D·2 bytes per token and writes as much: ~12 KB per token for Qwen3-4B
// (~3 ns); launch-bound at decode, bandwidth-bound for long prefills.
#include "rope.cuh"   // norm_rope_head

extern "C" __global__ void qk_norm_rope_cache(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm_w,
                                              const bf16_t* __restrict__ k_norm_w, float eps,
                                              const float* __restrict__ inv_freq, float attn_factor,
                                              const int* __restrict__ positions,
                                              const int* __restrict__ slot_mapping, bf16_t* __restrict__ q_out,
                                              bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                              int num_heads, int num_kv_heads, int D) {
    pdl_begin();
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const bf16_t* row = qkv + (size_t)t * (num_heads + 2 * num_kv_heads) * D;
    const int slot = slot_mapping[t];
    const float pos = (float)positions[t];
    for (int h = blockIdx.y * nwarps + warp; h < num_heads + 2 * num_kv_heads; h += nwarps * gridDim.y) {
        const bf16_t* src = row + (size_t)h * D;
        if (h < num_heads) {
            norm_rope_head(src, q_out + ((size_t)t * num_heads + h) * D, q_norm_w, eps, inv_freq, attn_factor, pos, D);
        } else if (slot >= 0 && h < num_heads + num_kv_heads) {
            const int kh = h - num_heads;
            norm_rope_head(src, k_cache + ((size_t)slot * num_kv_heads + kh) * D, k_norm_w, eps, inv_freq, attn_factor, pos, D);
        } else if (slot >= 0) {
            const int vh = h - num_heads - num_kv_heads;
            bf16_t* dst = v_cache + ((size_t)slot * num_kv_heads + vh) * D;
            for (int i = lane; i < D; i += 32) dst[i] = src[i];
        }
    }
}
