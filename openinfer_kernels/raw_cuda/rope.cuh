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

// The lane-group form, for D = 8 · LANES (LANES a power of two, 2 … 32: D 16, 32, 64, 128, 256): LANES lanes
// hold one head, each lane 8 consecutive values (one 16-byte piece x, at e0 = 8 · (lane % LANES)), so a warp
// serves 32 / LANES heads at once and every load and store is 16 bytes (norm_rope_head_with's lane per value
// moves 2). Every lane of the warp calls it (shuffles); a lane group may hold a query, key or value head:
// rotate false (a value head, or a group past the last head) returns x as it is; norm_w null: no norm.
// Returns the lane's 8 output values. Same roundings as norm_rope_head_with; the sum of squares in its own
// fixed order (each lane's 8 in order, then the group's butterfly) and the rotation as one explicit fma,
// so every kernel that calls it (qk_norm_rope_cache.cu, paged_decode.cu's fused entry) writes the same bits.
template <int LANES, typename Angle>
__device__ __forceinline__ uint4 norm_rope_piece(uint4 x, const bf16_t* __restrict__ norm_w, bool rotate, float eps,
                                                 Angle angle) {
    static_assert(LANES >= 2 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "a head is 2 to 32 lanes");
    constexpr int D = 8 * LANES, HALF = D / 2;
    const int e0 = 8 * (threadIdx.x % LANES);
    bf16_t* xs = reinterpret_cast<bf16_t*>(&x);
    float v[8];
    float ss = 0.f;
    #pragma unroll
    for (int k = 0; k < 8; ++k) {
        v[k] = bf16_to_f(xs[k]);
        ss = __fmaf_rn(v[k], v[k], ss);
    }
    #pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    uint4 n = x;                                         // the normed values, bf16 (exact in the words)
    if (rotate && norm_w != nullptr) {
        const float rstd = rsqrtf(ss / D + eps);
        n = rmsnorm8(x, *reinterpret_cast<const uint4*>(norm_w + e0), rstd);
    }
    uint4 y;                                             // the pair partners' normed values, HALF away
    y.x = (unsigned)__shfl_xor_sync(0xffffffffu, (int)n.x, LANES / 2);
    y.y = (unsigned)__shfl_xor_sync(0xffffffffu, (int)n.y, LANES / 2);
    y.z = (unsigned)__shfl_xor_sync(0xffffffffu, (int)n.z, LANES / 2);
    y.w = (unsigned)__shfl_xor_sync(0xffffffffu, (int)n.w, LANES / 2);
    if (!rotate) return x;                               // after the shuffles: every lane takes part
    const bool lo = e0 < HALF;                           // first half: a·c − b·s; second: b·c + a·s
    const int p0 = lo ? e0 : e0 - HALF;
    const bf16_t* ns = reinterpret_cast<const bf16_t*>(&n);
    const bf16_t* ys = reinterpret_cast<const bf16_t*>(&y);
    uint4 out;
    bf16_t* os = reinterpret_cast<bf16_t*>(&out);
    #pragma unroll
    for (int k = 0; k < 8; ++k) {
        float c, s;
        angle(p0 + k, c, s);
        const float ys_s = __fmul_rn(bf16_to_f(ys[k]), s);
        os[k] = f_to_bf16(__fmaf_rn(bf16_to_f(ns[k]), c, lo ? -ys_s : ys_s));
    }
    return out;
}

// norm_rope_piece's lanes per head for head dim D, or 0 where it does not apply (norm_rope_head_with then).
__host__ __device__ constexpr int rope_piece_lanes(int D) {
    return (D % 8 == 0 && D / 8 >= 2 && D / 8 <= 32 && ((D / 8) & (D / 8 - 1)) == 0) ? D / 8 : 0;
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
