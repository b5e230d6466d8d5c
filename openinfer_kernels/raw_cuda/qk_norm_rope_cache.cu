// Attention prologue for one step, grid (T, head groups), one warp per head:
//   q, k, v = split(qkv[t]);  q, k = per-head RMSNorm(q, k) (Qwen3, when weights are given);
//   q, k = rotary(q, k) neox style: angle_i = pos[t] · inv_freq[i], pairs (i, i + D/2), cos and sin
//          scaled by attn_factor (yarn; 1 otherwise);
//   q_out[t] = q;  k_cache[slot[t]] = k;  v_cache[slot[t]] = v   (slot < 0: padding, not written).
// Rounding follows the bf16 reference: normed and rotated values are rounded to bf16 once each.
// A block first puts its token's D/2 cosines and sines in shared memory (the same sincosf values
// rope.cuh's norm_rope_head computes per head), so a token's Hq + Hkv heads share one table: with a
// table per head the full-precision sincosf of thousand-radian angles, not the bytes, set the time (an
// 8k-token Qwen3-4B step: 6.3 ms of 36 layers where the bytes take ~1.7 ms). Launch few head groups
// (gridDim.y) per token for long steps; each group builds its own table.
// Roofline: reads (Hq + 2·Hkv)·D·2 bytes per token and writes as much: ~12 KB per token for Qwen3-4B
// (~3 ns); launch-bound at decode, bandwidth-bound for long prefills.
#include "rope.cuh"   // norm_rope_head_with, rope_angle

#define MAX_HALF 128   // D <= 256 (gpu_ops.MAX_HEAD_DIM)

extern "C" __global__ void qk_norm_rope_cache(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm_w,
                                              const bf16_t* __restrict__ k_norm_w, float eps,
                                              const float* __restrict__ inv_freq, float attn_factor,
                                              const int* __restrict__ positions,
                                              const int* __restrict__ slot_mapping, bf16_t* __restrict__ q_out,
                                              bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                              int num_heads, int num_kv_heads, int D) {
    __shared__ float cos_s[MAX_HALF], sin_s[MAX_HALF];
    pdl_begin();
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const bf16_t* row = qkv + (size_t)t * (num_heads + 2 * num_kv_heads) * D;
    const int slot = slot_mapping[t];
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < D / 2; i += blockDim.x) rope_angle(inv_freq, attn_factor, pos, i, cos_s[i], sin_s[i]);
    __syncthreads();
    auto table = [&](int i, float& c, float& s) { c = cos_s[i]; s = sin_s[i]; };
    for (int h = blockIdx.y * nwarps + warp; h < num_heads + 2 * num_kv_heads; h += nwarps * gridDim.y) {
        const bf16_t* src = row + (size_t)h * D;
        if (h < num_heads) {
            norm_rope_head_with(src, q_out + ((size_t)t * num_heads + h) * D, q_norm_w, eps, D, table);
        } else if (slot >= 0 && h < num_heads + num_kv_heads) {
            const int kh = h - num_heads;
            norm_rope_head_with(src, k_cache + ((size_t)slot * num_kv_heads + kh) * D, k_norm_w, eps, D, table);
        } else if (slot >= 0) {
            const int vh = h - num_heads - num_kv_heads;
            bf16_t* dst = v_cache + ((size_t)slot * num_kv_heads + vh) * D;
            for (int i = lane; i < D; i += 32) dst[i] = src[i];
        }
    }
}
