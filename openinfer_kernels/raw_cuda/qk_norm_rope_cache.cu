// Attention prologue for one step, grid (T, head groups), heads in lanes (below):
//   q, k, v = split(qkv[t]);  q, k = per-head RMSNorm(q, k) (Qwen3, when weights are given);
//   q, k = rotary(q, k) neox style: angle_i = pos[t] · inv_freq[i], pairs (i, i + D/2), cos and sin
//          scaled by attn_factor (yarn; 1 otherwise);
//   q_out[t] = q;  k_cache[slot[t]] = k;  v_cache[slot[t]] = v   (slot < 0: padding, not written).
// Rounding follows the bf16 reference: normed and rotated values are rounded to bf16 once each.
// A block first puts its token's D/2 cosines and sines in shared memory (the same sincosf values
// rope.cuh's norm_rope_head computes per head), so a token's Hq + Hkv heads share one table: with a
// table per head the full-precision sincosf of thousand-radian angles, not the bytes, set the time (an
// 8k-token Qwen3-4B step: 6.3 ms of 36 layers where the bytes take ~1.7 ms). Launch few head groups
// (gridDim.y) per token for long steps; each group builds its own table. Head dims 16 … 256 that are 8 times a
// power of two (rope_piece_lanes) move 16-byte pieces, D/8 lanes a head and 32/(D/8) heads a warp
// (rope.cuh's norm_rope_piece, the fused decode entry's function too: same bits); other head dims a warp a
// head, 2 bytes a lane (4.3 ms of that 8k-token step at D 128, ~120 µs a layer against ~47 µs of bytes).
// Roofline: reads (Hq + 2·Hkv)·D·2 bytes per token and writes as much: ~12 KB per token for Qwen3-4B
// (~3 ns); launch-bound at decode, bandwidth-bound for long prefills.
#include "rope.cuh"   // norm_rope_piece, norm_rope_head_with, rope_angle
#include "kv_fp8.cuh"  // store_kv8

#define MAX_HALF 128   // D <= 256 (gpu_ops.MAX_HEAD_DIM)

// Token t's heads in 16-byte pieces (D = 8 · LANES): lane group g of warp w takes head (block's first + w) ·
// 32/LANES + g, then strides by the grid's warps; q to q_out, k and v to their cache slot (slot < 0: not written;
// FP8: as e4m3 of k / k_scale, v / v_scale, kv_fp8.cuh).
template <int LANES, bool FP8, typename Table>
__device__ __forceinline__ void rope_heads_in_pieces(const bf16_t* __restrict__ row, const bf16_t* __restrict__ q_norm_w,
                                                     const bf16_t* __restrict__ k_norm_w, float eps, int t, int slot,
                                                     bf16_t* __restrict__ q_out, void* __restrict__ k_cache,
                                                     void* __restrict__ v_cache, int num_heads, int num_kv_heads,
                                                     Table table, float k_scale, float v_scale) {
    constexpr int D = 8 * LANES, PER_WARP = 32 / LANES;
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, lane = threadIdx.x & 31, e0 = 8 * (lane % LANES);
    const int heads = num_heads + 2 * num_kv_heads;
    for (int h0 = (blockIdx.y * nwarps + warp) * PER_WARP; h0 < heads; h0 += nwarps * gridDim.y * PER_WARP) {
        const int h = h0 + lane / LANES;                 // warp-uniform loop: every lane reaches the shuffles
        const bool live = h < heads, is_q = h < num_heads, is_k = !is_q && h < num_heads + num_kv_heads;
        const uint4 x = live ? *reinterpret_cast<const uint4*>(row + (size_t)h * D + e0) : kZero16;
        const uint4 out = norm_rope_piece<LANES>(x, is_q ? q_norm_w : k_norm_w, live && (is_q || is_k), eps, table);
        if (live && is_q) {
            *reinterpret_cast<uint4*>(q_out + ((size_t)t * num_heads + h) * D + e0) = out;
        } else if (live && slot >= 0) {
            const int kvh = h - num_heads - (is_k ? 0 : num_kv_heads);
            store_kv8<FP8>(is_k ? k_cache : v_cache, ((size_t)slot * num_kv_heads + kvh) * D + e0, out,
                           is_k ? k_scale : v_scale);
        }
    }
}

// The entries' work, the cache bf16 or e4m3 (FP8: head dims of rope_piece_lanes only, gpu_ops checks at start).
template <bool FP8>
__device__ __forceinline__ void norm_rope_cache(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm_w,
                                                const bf16_t* __restrict__ k_norm_w, float eps,
                                                const float* __restrict__ inv_freq, float attn_factor,
                                                const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                                bf16_t* __restrict__ q_out, void* __restrict__ k_cache,
                                                void* __restrict__ v_cache, int num_heads, int num_kv_heads, int D,
                                                float k_scale, float v_scale) {
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
#define PIECES(L) return rope_heads_in_pieces<L, FP8>(row, q_norm_w, k_norm_w, eps, t, slot, q_out, k_cache, v_cache, \
                                                       num_heads, num_kv_heads, table, k_scale, v_scale)
    switch (rope_piece_lanes(D)) {                       // block-uniform
        case 2: PIECES(2);
        case 4: PIECES(4);
        case 8: PIECES(8);
        case 16: PIECES(16);
        case 32: PIECES(32);
        default: break;
    }
#undef PIECES
    if constexpr (FP8) return;
    bf16_t* kc = static_cast<bf16_t*>(k_cache);
    bf16_t* vc = static_cast<bf16_t*>(v_cache);
    for (int h = blockIdx.y * nwarps + warp; h < num_heads + 2 * num_kv_heads; h += nwarps * gridDim.y) {
        const bf16_t* src = row + (size_t)h * D;
        if (h < num_heads) {
            norm_rope_head_with(src, q_out + ((size_t)t * num_heads + h) * D, q_norm_w, eps, D, table);
        } else if (slot >= 0 && h < num_heads + num_kv_heads) {
            const int kh = h - num_heads;
            norm_rope_head_with(src, kc + ((size_t)slot * num_kv_heads + kh) * D, k_norm_w, eps, D, table);
        } else if (slot >= 0) {
            const int vh = h - num_heads - num_kv_heads;
            bf16_t* dst = vc + ((size_t)slot * num_kv_heads + vh) * D;
            for (int i = lane; i < D; i += 32) dst[i] = src[i];
        }
    }
}

extern "C" __global__ void qk_norm_rope_cache(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm_w,
                                              const bf16_t* __restrict__ k_norm_w, float eps,
                                              const float* __restrict__ inv_freq, float attn_factor,
                                              const int* __restrict__ positions,
                                              const int* __restrict__ slot_mapping, bf16_t* __restrict__ q_out,
                                              bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                              int num_heads, int num_kv_heads, int D) {
    norm_rope_cache<false>(qkv, q_norm_w, k_norm_w, eps, inv_freq, attn_factor, positions, slot_mapping, q_out,
                           k_cache, v_cache, num_heads, num_kv_heads, D, 1.f, 1.f);
}

// The same into an e4m3 cache (kv_fp8.cuh): k / k_scale and v / v_scale, saturated.
extern "C" __global__ void qk_norm_rope_cache_fp8(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm_w,
                                                  const bf16_t* __restrict__ k_norm_w, float eps,
                                                  const float* __restrict__ inv_freq, float attn_factor,
                                                  const int* __restrict__ positions,
                                                  const int* __restrict__ slot_mapping, bf16_t* __restrict__ q_out,
                                                  unsigned char* __restrict__ k_cache,
                                                  unsigned char* __restrict__ v_cache, int num_heads,
                                                  int num_kv_heads, int D, float k_scale, float v_scale) {
    norm_rope_cache<true>(qkv, q_norm_w, k_norm_w, eps, inv_freq, attn_factor, positions, slot_mapping, q_out,
                          k_cache, v_cache, num_heads, num_kv_heads, D, k_scale, v_scale);
}
