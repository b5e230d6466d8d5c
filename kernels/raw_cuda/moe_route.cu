// Mixture-of-experts router, one warp per token, on the float32 router logits [T, E]:
//   p = softmax(logits[t]);  group-limited (groups > 1): experts outside the topk_groups groups of
//   highest max probability get score 0 (transformers' DeepseekV2TopkRouter), else score = p;
//   the top_k scores (ties: the lower expert id first, as the numpy reference), in order;
//   weights = those scores, renormalized to sum 1 when renorm (Qwen3-MoE norm_topk_prob), times scale.
// Writes weights float32 [T, top_k] and ids int32 [T, top_k]. Fixed grid, no host sync: graph-capturable.
// E <= MAX_E (each lane holds E / 32 scores), top_k <= 32, groups <= 32 and E % groups == 0.
// Roofline: reads T·E·4 bytes; E = 128: 512 B per token, launch-bound at decode (~2-3 µs).
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

extern "C" __global__ void __launch_bounds__(32 * WARPS)
moe_topk(const float* __restrict__ logits, float* __restrict__ weights, int* __restrict__ ids, int T, int E,
         int top_k, int renorm, float scale, int groups, int topk_groups) {
    pdl_begin();
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= T) return;
    const float* row = logits + (size_t)t * E;
    float p[PER_LANE];                       // expert lane + 32·e
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

    float score[PER_LANE];
    #pragma unroll
    for (int e = 0; e < PER_LANE; ++e) score[e] = lane + 32 * e < E ? p[e] : -1.f;   // -1: not an expert
    if (groups > 1) {
        // lane g < groups holds its group's best probability; the best topk_groups groups are kept
        const int size = E / groups;
        float best = -1.f;
        for (int g = 0; g < groups; ++g) {
            float v = -1.f;
            #pragma unroll
            for (int e = 0; e < PER_LANE; ++e) {
                const int x = lane + 32 * e;
                if (x < E && x / size == g) v = fmaxf(v, p[e]);
            }
            v = warp_max(v);
            if (lane == g) best = v;
        }
        unsigned keep = 0u;                  // bit g: group g kept
        for (int r = 0; r < topk_groups; ++r) {
            float v = (lane < groups && !((keep >> lane) & 1u)) ? best : -2.f;
            int i = lane;
            warp_argmax(v, i);
            keep |= 1u << i;
        }
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            if (x < E && !((keep >> (x / size)) & 1u)) score[e] = 0.f;
        }
    }
    float w_sel = 0.f, total = 0.f;
    int id_sel = 0;
    for (int k = 0; k < top_k; ++k) {
        float v = -2.f;
        int i = 0x7fffffff;
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            if (score[e] > v) { v = score[e]; i = x; }      // e ascending: the lower id wins a tie
        }
        warp_argmax(v, i);
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) if (lane + 32 * e == i) score[e] = -2.f;
        if (lane == k) { w_sel = v; id_sel = i; }
        total += v;
    }
    if (lane < top_k) {
        weights[(size_t)t * top_k + lane] = (renorm ? w_sel / total : w_sel) * scale;
        ids[(size_t)t * top_k + lane] = id_sel;
    }
}
