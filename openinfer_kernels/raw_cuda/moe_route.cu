// Mixture-of-experts router, one warp per token, on the float32 router logits [T, E]:
//   p = softmax(logits[t]), or sigmoid(logits[t]) when sigmoid (DeepSeek-V3);
//   choice = p, or p + bias when a score correction bias is given (bf16 [E]; noaux_tc);
//   group-limited (groups > 1): the topk_groups groups of highest group score are kept (the group's best
//   choice without a bias, transformers' DeepseekV2TopkRouter; the sum of its two best choices with one,
//   DeepseekV3TopkRouter), the other groups' experts leave the choice;
//   the top_k choices (ties: the lower expert id first, as the numpy reference), in order;
//   weights = their p (unbiased), renormalized to sum 1 when renorm (norm_topk_prob), times scale.
// Writes weights float32 [T, top_k] and ids int32 [T, top_k]. Fixed grid, no host sync: graph-capturable.
// E <= MAX_E (each lane holds E / 32 scores), top_k <= 32, groups <= 32 and E % groups == 0 (with a bias:
// E / groups >= 2). Roofline: reads T·E·4 bytes; E = 384: 1.5 KB per token, launch-bound at decode (~2-3 µs).
#include "common.cuh"

#define MAX_E 512
#define PER_LANE (MAX_E / 32)
#define WARPS 4

// The warp's best (value, index) pair: larger value, then lower index.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
}

// The warp's best two values among those each lane passes (v, w: its own best two).
__device__ __forceinline__ float warp_top2_sum(float v, float w) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const float ow = __shfl_xor_sync(0xffffffffu, w, o);
        const float hi = fmaxf(v, ov);
        w = fmaxf(fminf(v, ov), fmaxf(w, ow));
        v = hi;
    }
    return v + w;
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
moe_topk(const float* __restrict__ logits, const bf16_t* __restrict__ bias, float* __restrict__ weights,
         int* __restrict__ ids, int T, int E, int top_k, int renorm, float scale, int groups, int topk_groups,
         int sigmoid) {
    pdl_begin();
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= T) return;
    const float* row = logits + (size_t)t * E;
    float p[PER_LANE];                       // expert lane + 32·e
    if (sigmoid) {
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            p[e] = x < E ? 1.f / (1.f + expf(-row[x])) : 0.f;
        }
    } else {
        float m = -INFINITY;
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            p[e] = x < E ? row[x] : -INFINITY;
            m = fmaxf(m, p[e]);
        }
        m = warp_max(m);
        float s = 0.f;
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            p[e] = lane + 32 * e < E ? expf(p[e] - m) : 0.f;
            s += p[e];
        }
        s = warp_sum(s);
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) p[e] /= s;
    }

    float score[PER_LANE];                   // the choice; -inf: not an expert, outside the kept groups, or taken
    #pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
        const int x = lane + 32 * e;
        score[e] = x < E ? p[e] + (bias != nullptr ? bf16_to_f(bias[x]) : 0.f) : -INFINITY;
    }
    if (groups > 1) {
        // lane g < groups holds its group's score; the best topk_groups groups are kept
        const int size = E / groups;
        float best = -INFINITY;
        for (int g = 0; g < groups; ++g) {
            float v = -INFINITY, w = -INFINITY;          // this lane's best two in group g
            #pragma unroll
            for (int e = 0; e < PER_LANE; ++e) {
                const int x = lane + 32 * e;
                if (x < E && x / size == g) {
                    w = fmaxf(w, fminf(v, score[e]));
                    v = fmaxf(v, score[e]);
                }
            }
            const float gs = bias != nullptr ? warp_top2_sum(v, w) : warp_max(v);
            if (lane == g) best = gs;
        }
        unsigned keep = 0u;                  // bit g: group g kept
        for (int r = 0; r < topk_groups; ++r) {
            float v = (lane < groups && !((keep >> lane) & 1u)) ? best : -INFINITY;
            int i = lane < groups && !((keep >> lane) & 1u) ? lane : 0x7fffffff;
            warp_argmax(v, i);
            keep |= 1u << i;
        }
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            if (x < E && !((keep >> (x / size)) & 1u)) score[e] = -INFINITY;
        }
    }
    float w_sel = 0.f, total = 0.f;
    int id_sel = 0;
    for (int k = 0; k < top_k; ++k) {
        float v = -INFINITY;
        int i = 0x7fffffff;
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            if (score[e] > v) { v = score[e]; i = x; }      // e ascending: the lower id wins a tie
        }
        warp_argmax(v, i);
        float mine = 0.f;                    // the chosen expert's unbiased score, from the lane that holds it
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            if (lane + 32 * e == i) { mine = p[e]; score[e] = -INFINITY; }
        }
        const float w = __shfl_sync(0xffffffffu, mine, i & 31);
        if (lane == k) { w_sel = w; id_sel = i; }
        total += w;
    }
    if (lane < top_k) {
        weights[(size_t)t * top_k + lane] = (renorm ? w_sel / total : w_sel) * scale;
        ids[(size_t)t * top_k + lane] = id_sel;
    }
}
