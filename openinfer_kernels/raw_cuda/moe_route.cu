// Mixture-of-experts router, one warp per token, on the float32 router logits [T, E]:
//   p = softmax(logits[t]) (scoring 0), sigmoid(logits[t]) (1: DeepSeek-V3) or sqrt(softplus(logits[t]))
//   (2: DeepSeek-V4; softplus as torch's, x itself above 20);
//   choice = p, or p + bias when a score correction bias is given (bf16 [E]; noaux_tc);
//   group-limited (groups > 1): the topk_groups groups of highest group score are kept (the group's best
//   choice without a bias, transformers' DeepseekV2TopkRouter; the sum of its two best choices with one,
//   DeepseekV3TopkRouter), the other groups' experts leave the choice;
//   the top_k choices (ties: the lower expert id first, as the numpy reference), in order;
//   weights = their p (unbiased), renormalized to sum 1 when renorm (norm_topk_prob), times scale;
//   a slot with no comparable score left (NaN logits: a piecewise graph's padded row) gets id -1, weight 0,
//   which every expert kernel drops, never an out-of-range expert.
// Writes weights float32 [T, top_k] and ids int32 [T, top_k]. Fixed grid, no host sync: graph-capturable.
// moe_route_gemv (below) computes a decode step's logits itself and routes in its last CTA.
// E <= MAX_E (each lane holds MAX_E / 32 scores; built per model with MAX_E = 32 · ceil(E / 32)), top_k <= 32, groups <= 32 and E % groups == 0 (with a bias:
// E / groups >= 2). Roofline: reads T·E·4 bytes; E = 384: 1.5 KB per token, launch-bound at decode (~2-3 µs).
#include "common.cuh"

#ifndef MAX_E
#define MAX_E 512                            // compiled per model: 32 · ceil(E / 32) (gpu_moe_ops.take_moe)
#endif
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

// One token's routing by one warp: its float32 router logits `row` (read through L2: another CTA of the
// same kernel may have just written them) -> weights[t, :top_k], ids[t, :top_k].
__device__ __forceinline__ void route_token(const float* row, const bf16_t* __restrict__ bias,
                                            float* __restrict__ weights, int* __restrict__ ids, int t, int E,
                                            int top_k, int renorm, float scale, int groups, int topk_groups,
                                            int scoring) {
    const int lane = threadIdx.x & 31;
    float p[PER_LANE];                       // expert lane + 32·e
    if (scoring) {
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            const float l = x < E ? __ldcg(row + x) : 0.f;
            p[e] = x >= E ? 0.f : scoring == 1 ? 1.f / (1.f + expf(-l)) : sqrtf(l > 20.f ? l : log1pf(expf(l)));
        }
    } else {
        float m = -INFINITY;
        #pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int x = lane + 32 * e;
            p[e] = x < E ? __ldcg(row + x) : -INFINITY;
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
        if (i >= E) i = -1;                  // no score compares (NaN logits, e.g. a padded row): dropped, weight 0
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

extern "C" __global__ void __launch_bounds__(32 * WARPS)
moe_topk(const float* __restrict__ logits, const bf16_t* __restrict__ bias, float* __restrict__ weights,
         int* __restrict__ ids, int T, int E, int top_k, int renorm, float scale, int groups, int topk_groups,
         int scoring) {
    pdl_begin();
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= T) return;
    route_token(logits + (size_t)t * E, bias, weights, ids, t, E, top_k, renorm, scale, groups, topk_groups, scoring);
}

// The router of a decode step in one launch: logits[t, e] = x[t] · router[e] (bf16 in, fp32 sums; one warp
// per expert row, its lanes splitting H in 16-byte pieces, every token's row against the weight pieces it
// loaded), then the CTA that finishes last (a counter the kernel resets for the next launch: graph
// replays stay correct) routes every token as moe_topk. T <= ROUTE_TOKENS, H % 8 == 0; counter: one
// zeroed int that no other kernel uses at the same time. Replaces the router GEMM's cuBLAS launch and the
// top-k launch. A lane issues ROUTE_U weight pieces at once (H 2048: the whole row in one round trip; a
// loop of dependent loads measured 15 µs under ncu), the first before pdl_wait (the router is a weight:
// it streams while the kernel before finishes). Roofline: E·H·2 bytes (Qwen3-30B-A3B: 0.5 MB, ~0.1 µs at
// 4.3 TB/s): latency-bound, one DRAM round trip, one L2 round trip for x, the ticket and the top-k.
#define ROUTE_TOKENS 8
#define ROUTE_U 8
__device__ __forceinline__ void load_router_piece(uint4 (&wv)[ROUTE_U], const bf16_t* wrow, int k0, int H) {
    #pragma unroll
    for (int u = 0; u < ROUTE_U; ++u) {
        const int k = k0 + 256 * u;
        wv[u] = k < H ? *reinterpret_cast<const uint4*>(wrow + k) : kZero16;
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
moe_route_gemv(const bf16_t* __restrict__ x, const bf16_t* __restrict__ router, float* logits, int* counter,
               const bf16_t* __restrict__ bias, float* __restrict__ weights, int* __restrict__ ids, int T, int E,
               int H, int top_k, int renorm, float scale, int groups, int topk_groups, int scoring) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = blockIdx.x * WARPS + warp;
    const bf16_t* wrow = router + (size_t)min(e, E - 1) * H;
    uint4 wv[ROUTE_U];
    if (e < E) load_router_piece(wv, wrow, lane * 8, H);
    pdl_begin();
    if (e < E) {
        float acc[ROUTE_TOKENS];
        #pragma unroll
        for (int t = 0; t < ROUTE_TOKENS; ++t) acc[t] = 0.f;
        for (int k0 = lane * 8; k0 < H; k0 += 256 * ROUTE_U) {
            if (k0 != lane * 8) load_router_piece(wv, wrow, k0, H);
            #pragma unroll
            for (int t = 0; t < ROUTE_TOKENS; ++t) {
                if (t < T) {
                    uint4 xv[ROUTE_U];
                    #pragma unroll
                    for (int u = 0; u < ROUTE_U; ++u) {
                        const int k = k0 + 256 * u;
                        xv[u] = k < H ? *reinterpret_cast<const uint4*>(x + (size_t)t * H + k) : kZero16;
                    }
                    #pragma unroll
                    for (int u = 0; u < ROUTE_U; ++u) {
                        const bf16_t* ws = reinterpret_cast<const bf16_t*>(&wv[u]);
                        const bf16_t* xs = reinterpret_cast<const bf16_t*>(&xv[u]);
                        #pragma unroll
                        for (int i = 0; i < 8; ++i) acc[t] += bf16_to_f(xs[i]) * bf16_to_f(ws[i]);
                    }
                }
            }
        }
        #pragma unroll
        for (int t = 0; t < ROUTE_TOKENS; ++t) {
            if (t < T) {                     // T is uniform: the shuffles of the step's rows only
                const float s = warp_sum(acc[t]);
                if (lane == 0) logits[(size_t)t * E + e] = s;
            }
        }
    }
    __shared__ int last;
    __threadfence();                         // this CTA's logits reach L2 before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = warp; t < T; t += WARPS)
        route_token(logits + (size_t)t * E, bias, weights, ids, t, E, top_k, renorm, scale, groups, topk_groups,
                    scoring);
    if (threadIdx.x == 0) *counter = 0;
}

// moe_hash_route: DeepSeek-V4's hash router (cpu_dsv4_ops.hash_route): token t's experts are its row of the frozen
// table tid2eid (int32 [vocab, top_k]) at input_ids[t]; their weights the sqrtsoftplus of their logits (float32
// [T, E]), renormalized to sum 1 (summed in slot order), times scale. One thread a token; fixed grid, graph-capturable.
// Roofline: T · top_k · 12 bytes: launch-bound.
extern "C" __global__ void moe_hash_route(const float* __restrict__ logits, const int* __restrict__ tid2eid,
                                          const int* __restrict__ input_ids, float* __restrict__ weights,
                                          int* __restrict__ ids, int T, int E, int top_k, float scale) {
    pdl_begin();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int* row = tid2eid + (size_t)input_ids[t] * top_k;
    float* w = weights + (size_t)t * top_k;
    float sum = 0.f;
    for (int j = 0; j < top_k; ++j) {
        const int e = row[j];
        const float l = logits[(size_t)t * E + e];
        w[j] = sqrtf(l > 20.f ? l : log1pf(expf(l)));
        ids[(size_t)t * top_k + j] = e;
        sum += w[j];
    }
    for (int j = 0; j < top_k; ++j) w[j] = w[j] / sum * scale;
}
