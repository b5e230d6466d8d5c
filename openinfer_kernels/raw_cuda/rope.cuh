// Per-head q/k prologue of attention, shared by qk_norm_rope_cache.cu and paged_decode.cu's fused entry.
#pragma once
#include "common.cuh"

// One warp: dst[D] = rotary(rmsnorm(src[D]) · norm_w) (the norm only when norm_w is given), neox style on
// the pairs (i, i + D/2) with angle(i, c, s) giving cos and sin of pair i (already scaled by attn_factor).
// Rounds like the bf16 reference: the normed and the rotated values to bf16 once each. dst may be global or
// shared memory.
template <typename Angle>
__device__ __forceinline__ void norm_rope_head_with(const bf16_t* __restrict__ src, bf16_t* __restrict__ dst,
                                                    const bf16_t* __restrict__ norm_w, float eps, int D,
                                                    Angle angle) {
    const int lane = threadIdx.x & 31, half = D / 2;
    float rstd = 1.f;
    if (norm_w != nullptr) {
        float ss = 0.f;
        for (int i = lane; i < D; i += 32) { float f = bf16_to_f(src[i]); ss += f * f; }
        rstd = rsqrtf(warp_sum(ss) / D + eps);
    }
    for (int i = lane; i < half; i += 32) {
        float a = bf16_to_f(src[i]), b = bf16_to_f(src[i + half]);
        if (norm_w != nullptr) {
            a = round_bf16(bf16_to_f(norm_w[i]) * round_bf16(a * rstd));
            b = round_bf16(bf16_to_f(norm_w[i + half]) * round_bf16(b * rstd));
        }
        float s, c;
        angle(i, c, s);
        dst[i] = f_to_bf16(a * c - b * s);
        dst[i + half] = f_to_bf16(b * c + a * s);
    }
}

// cos and sin of pair i at position pos: angle pos · inv_freq[i], both scaled by attn_factor (yarn; 1
// otherwise). Full-precision sincosf: the angles reach thousands of radians.
__device__ __forceinline__ void rope_angle(const float* __restrict__ inv_freq, float attn_factor, float pos, int i,
                                           float& c, float& s) {
    sincosf(pos * inv_freq[i], &s, &c);
    s *= attn_factor;
    c *= attn_factor;
}

// norm_rope_head_with, the angle computed in place (one head: paged_decode.cu's fused entry).
__device__ __forceinline__ void norm_rope_head(const bf16_t* __restrict__ src, bf16_t* __restrict__ dst,
                                               const bf16_t* __restrict__ norm_w, float eps,
                                               const float* __restrict__ inv_freq, float attn_factor, float pos, int D) {
    norm_rope_head_with(src, dst, norm_w, eps, D, [&](int i, float& c, float& s) {
        rope_angle(inv_freq, attn_factor, pos, i, c, s);
    });
}
