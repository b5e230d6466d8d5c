// Paged decode attention shaped for bandwidth: same contract as paged_attention_split (query token t of
// sequence token_seq[t] at position positions[t] attends to KV positions [0, positions[t]] through the
// 16-token block table; padded tokens, positions[t] < 0, give zeros), built for many keys in flight.
// Compiled per (GQA = Hq/Hkv, HEAD_DIM, HEADS) with -D options, so q, the accumulators and the loads live
// in registers. Grid (T, num_splits, Hkv·GQA/HEADS), 4 warps: one CTA per (token, KV split, KV head, head
// group) serves HEADS query heads of the group from one read of each K and V row. HEADS = GQA (the
// default) reads each K/V row once per split; a smaller HEADS (small grids: batch 1, few KV heads) gives
// GQA/HEADS CTAs per (split, KV head), each with a shorter serial chain of dots, softmax, P·V and merge
// (at batch 1 the CTAs are latency-bound: Qwen3-30B-A3B, GQA 8, 20 CTAs of 4 warps, one warp per
// scheduler issuing every 6.4 cycles; the repeated K/V reads hit L2). The token is the fastest grid index, so the
// CTAs of one (split, KV head) start together: the query rows of one sequence (a chunk, a prefix hit's
// recomputed block) read the same K/V rows at about the same time, once from DRAM and then from L2,
// instead of once per row.
//  * KEY_LANES lanes share a key (one 16-byte piece each: 8 bf16 of D), so a warp reads 32/KEY_LANES keys
//    per pass; UNROLL passes (K and V) make one iteration (D 128: 8 keys, 4 KB). The pieces go to the
//    warp's shared-memory ring by cp.async (no registers held while in flight), STAGES − 1 iterations
//    ahead of the one being scored, so loads stay in flight through the math; the block-table entries are
//    read one issue ahead. With the loads out of the registers the GQA 4 × D 128 build fits 128 registers:
//    4 CTAs (16 warps) per SM instead of 3, each with up to 8 KB in flight (H200, Qwen3-4B decode at
//    batch ~200 and 1.1k context: the register-pipelined kernel before reached ~2.3 TB/s).
//  * scores in the log2 domain (q pre-scaled by scale·log2 e, exp2f), online softmax per warp (the running
//    max is warp-uniform, the sums and P·V stay per lane; they are rescaled only when the max moves, bits
//    unchanged), then one merge of the warps in shared memory. A key's HEADS dots are summed over its lanes by
//    halving exchanges (key_sums). At batch ~200 and 1k keys the loop is near the SM's issue rate (~630
//    instructions a warp per 4 KB of K/V at GQA 4 × D 128, where HBM's rate allows ~880): its shuffles,
//    adds and rescales were a quarter of them.
//  * num_splits == 1: the CTA writes the normalized bf16 output itself. Otherwise it writes its fp32 partial
//    (acc, max in natural-log units, sum: attention_merge's layout) and takes a ticket from
//    counters[t·Hkv + kvh]; the last split's CTA merges all of them and resets the counter to 0 (the
//    buffer starts zeroed and is zero again after every launch, so graphs replay it as is): no merge launch.
//  * The first trip's block-table entries are read, and its K/V rows prefetched into L2, before pdl_wait
//    (no kernel of the step writes them), so they overlap the previous kernel's tail.
//  * rope_paged_decode_attention (decode steps: one query token per sequence; paged_decode_prologue.cuh) also does
//    qk_norm_rope_cache.cu's work: each CTA norms and ropes its group's query heads from the qkv row into
//    shared memory (rope.cuh, same roundings); the split that holds position positions[t] also builds
//    that token's K and V, takes them from shared memory as its last key and writes them to the cache at
//    slot_mapping[t] (< 0: not written). The other splits read only positions < positions[t]. Same
//    bits as the two kernels, one launch and one dependent round trip fewer.
// Roofline (decode, batch B, context C): bytes = B·C·Hkv·D·2·2 (K and V once per KV head) per layer;
// Qwen3-4B (Hkv 8, D 128) at C = 4096: 16.8 MB/layer per sequence, 3.9 µs at 4.3 TB/s. At batch 1 and
// C ~ 256 (1 MB/layer) it is latency-bound: two dependent DRAM round trips (table, K/V) plus the merge;
// the fused entry adds (GQA + 2)·D·2 bytes of the qkv row per CTA (L2-resident: the GEMV just wrote it).
#include "common.cuh"    // bf16_t, pdl_begin / pdl_wait, cp.async
#include "attention_shape.cuh"   // GQA, HEAD_DIM, WARPS, NTHREADS
#include "kv_fp8.cuh"            // the e4m3 cache of paged_decode_attention_fp8
#ifndef HEADS
#define HEADS GQA                                        // query heads per CTA (a divisor of GQA)
#endif
#define GROUPS (GQA / HEADS)                             // CTAs per (token, split, KV head)
static_assert(GQA % HEADS == 0, "HEADS divides the group");
#define VEC 8                                            // bf16 per 16-byte load
#define DV (HEAD_DIM / VEC)
#define KEY_LANES ((DV <= 16 && (DV & (DV - 1)) == 0) ? DV : 16)
#define CHUNKS ((DV + KEY_LANES - 1) / KEY_LANES)        // 16-byte loads per lane per key row
#define KEYS_PER_PASS (32 / KEY_LANES)
#ifndef UNROLL
#define UNROLL 4                                         // passes per warp iteration (one pipeline stage)
#endif
#ifndef STAGES
#define STAGES (CHUNKS == 1 ? 2 : 1)                     // stages per warp's shared-memory ring
#endif
#ifndef MIN_CTAS                                         // __launch_bounds__: CTAs per SM the registers allow
#define MIN_CTAS (HEADS * CHUNKS <= 4 ? 4 : 1)           // 4 heads x D 128: 128 registers, no spills
#endif
#define KEYS_PER_ITER (KEYS_PER_PASS * UNROLL)
#define STAGE_VECS (UNROLL * CHUNKS * 2 * 32)             // 16-byte K and V pieces of one stage, per warp
#define RING_BYTES_PER_WARP (STAGES * STAGE_VECS * 16)
static_assert(HEADS * HEAD_DIM * 4 <= RING_BYTES_PER_WARP, "a warp's partial output fits its ring");
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define MAX_SPLITS 64                                    // gpu_ops.MAX_DECODE_SPLITS

__device__ __forceinline__ void unpack8(const uint4 v, float f[VEC]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// Butterfly over the lanes of one key (offsets < KEY_LANES), or across the keys of a warp (>= KEY_LANES).
__device__ __forceinline__ float key_sum(float v) {
    #pragma unroll
    for (int o = KEY_LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// The HEADS dot products of one key, each summed over the key's KEY_LANES lanes, into v[g] on every lane: the
// bits of key_sum on each (the same pairs added in the same order: own + partner), with log2(HEADS) halving
// exchanges (at offset o a lane keeps half its values and trades the other half with its partner), the
// butterfly's remaining levels on the one value left, and HEADS broadcasts: GQA 4 × D 128, 9 shuffles a key
// instead of 16 (the decode loop's shuffles and adds were ~20% of its instructions). Lane sub of a key holds
// head sub / (KEY_LANES / HEADS) at the end.
#define HALVING_SUMS (HEADS > 1 && HEADS <= KEY_LANES && (HEADS & (HEADS - 1)) == 0)
template <int N, int O>
__device__ __forceinline__ float halving_sum(float (&w)[HEADS], int sub) {
    if constexpr (O == 0) {
        return w[0];
    } else if constexpr (N == 1) {
        w[0] += __shfl_xor_sync(0xffffffffu, w[0], O);
        return halving_sum<1, O / 2>(w, sub);
    } else {
        const bool high = (sub & O) != 0;                // keeps the upper half, sends the lower
        #pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const float send = high ? w[i] : w[N / 2 + i];
            const float keep = high ? w[N / 2 + i] : w[i];
            w[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
        }
        return halving_sum<N / 2, O / 2>(w, sub);
    }
}
__device__ __forceinline__ void key_sums(float (&v)[HEADS]) {
    const int lane = threadIdx.x & 31, sub = lane % KEY_LANES;
    if constexpr (HALVING_SUMS) {
        float w[HEADS];
        #pragma unroll
        for (int g = 0; g < HEADS; ++g) w[g] = v[g];
        const float mine = halving_sum<HEADS, KEY_LANES / 2>(w, sub);
        #pragma unroll
        for (int g = 0; g < HEADS; ++g) v[g] = __shfl_sync(0xffffffffu, mine, lane - sub + g * (KEY_LANES / HEADS));
    } else {
        #pragma unroll
        for (int g = 0; g < HEADS; ++g) v[g] = key_sum(v[g]);
    }
}
__device__ __forceinline__ float across_keys_max(float v) {
    #pragma unroll
    for (int o = KEY_LANES; o < 32; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float across_keys_sum(float v) {
    #pragma unroll
    for (int o = KEY_LANES; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#include "paged_decode_prologue.cuh"   // RopeArgs, rope_prologue (the fused entries)

// The attention of one CTA (split, KV head, token); ROPE: q (and the step's own key) from the qkv
// row through rope_prologue instead of from q; LORA: with the row's adapter delta; FP8: the cache holds e4m3
// (kv_fp8.cuh; not with ROPE): each lane's 8-value piece is 8 bytes (cp.async of 8), widened after the load,
// k_scale folded into q and v_scale into the output.
template <bool ROPE, bool LORA = false, bool FP8 = false>
__device__ __forceinline__ void decode_attention(const bf16_t* __restrict__ q, void* k_cache, void* v_cache,
                                                 const int* __restrict__ block_tables, int max_blocks,
                                                 const int* __restrict__ token_seq, const int* __restrict__ positions,
                                                 float* __restrict__ part_out, float* __restrict__ part_max,
                                                 float* __restrict__ part_sum, bf16_t* __restrict__ out,
                                                 int* __restrict__ counters, int num_kv_heads, float scale,
                                                 const RopeArgs& r, float k_scale = 1.f, float v_scale = 1.f) {
    static_assert(!(ROPE && FP8), "the fused rope entries write bf16 keys");
    typedef typename KVElem<FP8>::type KV;
    // Each warp's ring of STAGES stages (lane-private 16-byte pieces: [stage][u][c][K|V][lane]); after
    // the key loop the same bytes hold the warp's partial output for the merge (acc of warp w at w's ring).
    __shared__ __align__(16) uint4 ring[WARPS][STAGES * STAGE_VECS];
    __shared__ float m_s[WARPS][HEADS], l_s[WARPS][HEADS];
    __shared__ float weight_s[HEADS][MAX_SPLITS];
    __shared__ int is_last;
    __shared__ __align__(16) bf16_t q_s[ROPE ? HEADS : 1][HEAD_DIM];
    __shared__ __align__(16) bf16_t kv_s[ROPE ? 2 : 1][HEAD_DIM];
    __shared__ __align__(16) bf16_t lora_s[LORA ? LORA_ROWS : 1][HEAD_DIM];
    __shared__ float h_s[LORA ? 3 * LORA_R : 1];

    const int t = blockIdx.x, split = blockIdx.y, kvh = blockIdx.z / GROUPS, hg = blockIdx.z % GROUPS;
    const int S = gridDim.y, num_heads = num_kv_heads * GQA, head0 = kvh * GQA + hg * HEADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int key = lane / KEY_LANES, sub = lane % KEY_LANES;
    const int ctx = positions[t] + 1;                       // 0 for padded tokens
    const int per_split = ((ctx + S - 1) / S + 15) / 16 * 16;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;
    const size_t row_stride = (size_t)num_kv_heads * HEAD_DIM;
    const KV* kbase = static_cast<const KV*>(k_cache) + (size_t)kvh * HEAD_DIM;
    const KV* vbase = static_cast<const KV*>(v_cache) + (size_t)kvh * HEAD_DIM;

    // The block tables, positions and the keys before this step's are written by the host or by
    // kernels that completed before the previous one (the previous kernel writes q, or nothing this
    // reads): the first trip's slots are fetched, and its K/V rows prefetched into L2, before pdl_wait.
    const int stride = WARPS * KEYS_PER_ITER;
    int slot_next[UNROLL];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int p = start + warp * KEYS_PER_ITER + u * KEYS_PER_PASS + key;
        slot_next[u] = p < end ? table[p >> 4] * 16 + (p & 15) : -1;
        #pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = (c * KEY_LANES + sub) * VEC;
            if (slot_next[u] >= 0 && d0 < HEAD_DIM) {
                prefetch_l2(kbase + (size_t)slot_next[u] * row_stride + d0);
                prefetch_l2(vbase + (size_t)slot_next[u] * row_stride + d0);
            }
        }
    }
    // LoRA: the row's slot (uploaded with the step) and its B rows of this CTA's columns (a weight) start
    // towards L2 too.
    const int lora_slot = LORA && r.lora_slots != nullptr ? r.lora_slots[t] : -1;
    if (LORA && lora_slot >= 0) {
        const bool owner = start < end && end == ctx;
        for (int j = 0; j < HEADS + (owner ? 2 : 0); ++j) {
            const char* b = reinterpret_cast<const char*>(
                r.lora_b + ((size_t)lora_slot * r.lora_n + (size_t)staged_head(j, head0, kvh, num_heads, num_kv_heads)
                            * HEAD_DIM) * LORA_R);
            for (int off = threadIdx.x * 128; off < HEAD_DIM * LORA_R * 2; off += NTHREADS * 128) prefetch_l2(b + off);
        }
    }
    pdl_begin();

    int fresh = -1;                                         // the key taken from kv_s (ROPE)
    if constexpr (ROPE)
        fresh = rope_prologue<LORA>(r, t, kvh, head0, num_kv_heads, ctx, start < end && end == ctx, hg == 0, q_s,
                                    kv_s, static_cast<bf16_t*>(k_cache), static_cast<bf16_t*>(v_cache), lora_slot,
                                    lora_s, h_s);
    const bf16_t* qg = ROPE ? &q_s[0][0] : q + ((size_t)t * num_heads + head0) * HEAD_DIM;
    // This lane's slices of the group's query heads, scaled into the log2 domain.
    float qf[HEADS][CHUNKS][VEC];
    #pragma unroll
    for (int g = 0; g < HEADS; ++g)
        #pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = (c * KEY_LANES + sub) * VEC;
            uint4 raw = make_uint4(0, 0, 0, 0);
            if (d0 < HEAD_DIM) raw = *reinterpret_cast<const uint4*>(qg + g * HEAD_DIM + d0);
            unpack8(raw, qf[g][c]);
            #pragma unroll
            for (int e = 0; e < VEC; ++e) qf[g][c][e] *= scale * LOG2E * k_scale;   // k_scale 1 unless FP8
        }
    float acc[HEADS][CHUNKS][VEC], m[HEADS], l[HEADS];
    #pragma unroll
    for (int g = 0; g < HEADS; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        #pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
            #pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][c][e] = 0.f;
    }

    // Software pipeline per warp: the K/V pieces of STAGES − 1 iterations ahead are in flight (cp.async into
    // the warp's ring) while this one is scored; the block-table entries are read one issue ahead.
    uint4* my_ring = ring[warp];
    auto piece = [&](int stage, int u, int c, int kv) -> uint4* {
        return my_ring + (((stage * UNROLL + u) * CHUNKS + c) * 2 + kv) * 32 + lane;
    };
    auto issue = [&](int stage, int b) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int slot = slot_next[u];
            const bool own = ROPE && b + u * KEYS_PER_PASS + key == fresh;     // not in the cache yet
            #pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = (c * KEY_LANES + sub) * VEC;
                const bool ok = slot >= 0 && d0 < HEAD_DIM && !own;
                const size_t off = ok ? (size_t)slot * row_stride + d0 : 0;
                if constexpr (FP8) {
                    cp_async8(piece(stage, u, c, 0), kbase + off, ok);
                    cp_async8(piece(stage, u, c, 1), vbase + off, ok);
                } else {
                    cp_async16(piece(stage, u, c, 0), kbase + off, ok);
                    cp_async16(piece(stage, u, c, 1), vbase + off, ok);
                }
            }
            const int p = b + stride + u * KEYS_PER_PASS + key;
            slot_next[u] = p < end ? table[p >> 4] * 16 + (p & 15) : -1;
        }
        cp_async_commit();
    };
    const int first = start + warp * KEYS_PER_ITER;
    int ahead = first;
    #pragma unroll
    for (int st = 0; st < STAGES - 1; ++st, ahead += stride) issue(st, ahead);
    int stage = 0;
    for (int base = first; base < end; base += stride, ahead += stride) {
        issue((stage + STAGES - 1) % STAGES, ahead);       // the stage the previous iteration consumed
        cp_async_wait<STAGES - 1>();
        float s[UNROLL][HEADS];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const bool valid = base + u * KEYS_PER_PASS + key < end;
            const bool own = ROPE && base + u * KEYS_PER_PASS + key == fresh;
            float kf[CHUNKS][VEC];
            #pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = (c * KEY_LANES + sub) * VEC;
                uint4 kr = *piece(stage, u, c, 0);
                if (own && d0 < HEAD_DIM) kr = *reinterpret_cast<const uint4*>(&kv_s[0][d0]);
                if constexpr (FP8) e4m3x8_to_float(make_uint2(kr.x, kr.y), 1.f, kf[c]);
                else unpack8(kr, kf[c]);
            }
            float dot[HEADS];
            #pragma unroll
            for (int g = 0; g < HEADS; ++g) {
                dot[g] = 0.f;
                #pragma unroll
                for (int c = 0; c < CHUNKS; ++c)
                    #pragma unroll
                    for (int e = 0; e < VEC; ++e) dot[g] = fmaf(qf[g][c][e], kf[c][e], dot[g]);
            }
            key_sums(dot);
            #pragma unroll
            for (int g = 0; g < HEADS; ++g) s[u][g] = valid ? dot[g] : -INFINITY;
        }
        #pragma unroll
        for (int g = 0; g < HEADS; ++g) {
            float mx = s[0][g];
            #pragma unroll
            for (int u = 1; u < UNROLL; ++u) mx = fmaxf(mx, s[u][g]);
            const float m_new = fmaxf(m[g], across_keys_max(mx));   // finite: the warp's first key is valid
            if (m_new != m[g]) {           // warp-uniform; an unchanged max scales by exp2(0) = 1: nothing to do
                const float alpha = exp2f(m[g] - m_new);
                m[g] = m_new;
                l[g] *= alpha;
                #pragma unroll
                for (int c = 0; c < CHUNKS; ++c)
                    #pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[g][c][e] *= alpha;
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                s[u][g] = exp2f(s[u][g] - m_new);                // the key's weight: 0 for invalid keys
                l[g] += s[u][g];
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const bool own = ROPE && base + u * KEYS_PER_PASS + key == fresh;
            #pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = (c * KEY_LANES + sub) * VEC;
                uint4 vr = *piece(stage, u, c, 1);
                if (own && d0 < HEAD_DIM) vr = *reinterpret_cast<const uint4*>(&kv_s[ROPE ? 1 : 0][d0]);
                float vf[VEC];
                if constexpr (FP8) e4m3x8_to_float(make_uint2(vr.x, vr.y), 1.f, vf);
                else unpack8(vr, vf);
                #pragma unroll
                for (int g = 0; g < HEADS; ++g)
                    #pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[g][c][e] = fmaf(s[u][g], vf[e], acc[g][c][e]);
            }
        }
        stage = (stage + 1) % STAGES;
    }
    cp_async_wait<0>();                                     // the ring becomes the warp's partial output,
    __syncwarp();                                           // once every lane's copies (zero fills too) landed
    auto acc_w = [&](int w) { return reinterpret_cast<float (*)[HEAD_DIM]>(ring[w]); };
    // Warp totals: every key lane-group of the warp shares the warp's running max.
    #pragma unroll
    for (int g = 0; g < HEADS; ++g) {
        l[g] = across_keys_sum(l[g]);
        #pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
            #pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][c][e] = across_keys_sum(acc[g][c][e]);
        if (lane == 0) { m_s[warp][g] = m[g]; l_s[warp][g] = l[g]; }
        if (key == 0) {
            #pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = (c * KEY_LANES + sub) * VEC;
                if (d0 < HEAD_DIM)
                    #pragma unroll
                    for (int e = 0; e < VEC; ++e) acc_w(warp)[g][d0 + e] = acc[g][c][e];
            }
        }
    }
    __syncthreads();
    // Merge the warps: one thread per (head of the group, d).
    for (int i = threadIdx.x; i < HEADS * HEAD_DIM; i += NTHREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) if (l_s[w][g] > 0.f) mx = fmaxf(mx, m_s[w][g]);
        float o = 0.f, sum = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            if (l_s[w][g] > 0.f) {
                const float f = exp2f(m_s[w][g] - mx);
                o += acc_w(w)[g][d] * f;
                sum += l_s[w][g] * f;
            }
        }
        o *= v_scale;                                       // 1 unless FP8: exact
        const size_t head = (size_t)t * num_heads + head0 + g;
        if (S == 1) {
            out[head * HEAD_DIM + d] = f_to_bf16(sum > 0.f ? o / sum : 0.f);
        } else {
            const size_t row = head * S + split;
            part_out[row * HEAD_DIM + d] = o;
            if (d == 0) { part_max[row] = mx * LN2; part_sum[row] = sum; }
        }
    }
    if (S == 1) return;
    __threadfence();                                        // this CTA's partials, visible before its ticket
    __syncthreads();
    int* counter = counters + ((size_t)t * num_kv_heads + kvh) * GROUPS + hg;
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == S - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // The last CTA: per head, the splits' weights e^(m_s − m) / Σ e^(m_s − m)·l_s (one warp per head) ...
    for (int g = warp; g < HEADS; g += WARPS) {
        const size_t rows = ((size_t)t * num_heads + head0 + g) * S;
        split_weights(part_max + rows, part_sum + rows, S, weight_s[g], lane);
    }
    __syncthreads();
    // ... then o[head, d] = Σ_s weight_s · out_s[d] over the non-empty splits (the first `live`; an
    // empty split's partial is 0), unrolled without branches so the L2 reads overlap.
    const int live = per_split > 0 ? min(S, (ctx + per_split - 1) / per_split) : 0;
    for (int i = threadIdx.x; i < HEADS * HEAD_DIM; i += NTHREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        const size_t head = (size_t)t * num_heads + head0 + g;
        const float* src = part_out + head * S * HEAD_DIM + d;
        float o = 0.f;
        #pragma unroll 8
        for (int sp = 0; sp < live; ++sp) o = fmaf(__ldcg(src + (size_t)sp * HEAD_DIM), weight_s[g][sp], o);
        out[head * HEAD_DIM + d] = f_to_bf16(o);
    }
    if (threadIdx.x == 0) *counter = 0;
}

extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
paged_decode_attention(const bf16_t* __restrict__ q, const bf16_t* k_cache, const bf16_t* v_cache,
                       const int* __restrict__ block_tables, int max_blocks,
                       const int* __restrict__ token_seq, const int* __restrict__ positions,
                       float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
                       bf16_t* __restrict__ out, int* __restrict__ counters, int num_kv_heads, float scale) {
    decode_attention<false>(q, const_cast<bf16_t*>(k_cache), const_cast<bf16_t*>(v_cache), block_tables,
                            max_blocks, token_seq, positions, part_out, part_max, part_sum, out, counters,
                            num_kv_heads, scale, RopeArgs{});
}

// The same over an e4m3 cache (kv_fp8.cuh): k_scale, v_scale its per-tensor scales.
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
paged_decode_attention_fp8(const bf16_t* __restrict__ q, const unsigned char* k_cache, const unsigned char* v_cache,
                           const int* __restrict__ block_tables, int max_blocks,
                           const int* __restrict__ token_seq, const int* __restrict__ positions,
                           float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
                           bf16_t* __restrict__ out, int* __restrict__ counters, int num_kv_heads, float scale,
                           float k_scale, float v_scale) {
    decode_attention<false, false, true>(q, const_cast<unsigned char*>(k_cache), const_cast<unsigned char*>(v_cache),
                                         block_tables, max_blocks, token_seq, positions, part_out, part_max, part_sum,
                                         out, counters, num_kv_heads, scale, RopeArgs{}, k_scale, v_scale);
}

// One query token per sequence (decode): q/k norm + rope + KV write (qk_norm_rope_cache.cu) and the
// attention above in one launch, same results bit for bit.
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
rope_paged_decode_attention(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm_w,
                            const bf16_t* __restrict__ k_norm_w, float eps, const float* __restrict__ inv_freq,
                            float attn_factor, const int* __restrict__ slot_mapping, bf16_t* k_cache,
                            bf16_t* v_cache, const int* __restrict__ block_tables, int max_blocks,
                            const int* __restrict__ token_seq, const int* __restrict__ positions,
                            float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
                            bf16_t* __restrict__ out, int* __restrict__ counters, int num_kv_heads, float scale) {
    const RopeArgs r{qkv, q_norm_w, k_norm_w, eps, inv_freq, attn_factor, slot_mapping,
                     num_kv_heads * (GQA + 2) * HEAD_DIM, nullptr, nullptr, 0};
    decode_attention<true>(nullptr, k_cache, v_cache, block_tables, max_blocks, token_seq, positions, part_out,
                           part_max, part_sum, out, counters, num_kv_heads, scale, r);
}

#ifndef NO_LORA_ENTRY
// The same with the step's LoRA deltas at the q/k/v projection added in the prologue (the qkv rows are
// the product by the weight extended with every slot's A: row_stride columns, the shrink after lora_n),
// so no kernel compacts the product between them (GpuLoRAOps.qkv_rope_attention). LORA_R % 8 == 0.
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
rope_paged_decode_attention_lora(const bf16_t* __restrict__ qkv, int row_stride, const int* __restrict__ lora_slots,
                                 const bf16_t* __restrict__ lora_b, const bf16_t* __restrict__ q_norm_w,
                                 const bf16_t* __restrict__ k_norm_w, float eps, const float* __restrict__ inv_freq,
                                 float attn_factor, const int* __restrict__ slot_mapping, bf16_t* k_cache,
                                 bf16_t* v_cache, const int* __restrict__ block_tables, int max_blocks,
                                 const int* __restrict__ token_seq, const int* __restrict__ positions,
                                 float* __restrict__ part_out, float* __restrict__ part_max,
                                 float* __restrict__ part_sum, bf16_t* __restrict__ out, int* __restrict__ counters,
                                 int num_kv_heads, float scale) {
    const RopeArgs r{qkv, q_norm_w, k_norm_w, eps, inv_freq, attn_factor, slot_mapping, row_stride, lora_slots,
                     lora_b, num_kv_heads * (GQA + 2) * HEAD_DIM};
    decode_attention<true, true>(nullptr, k_cache, v_cache, block_tables, max_blocks, token_seq, positions,
                                 part_out, part_max, part_sum, out, counters, num_kv_heads, scale, r);
}
#endif
