// MLA attention in the absorbed form (DeepSeek-V2 decode), over the paged latent cache
// cache[slot] = [c (KV_RANK) | k_rope (ROPE_DIM)] (mla_latent_cache.cu). Query token t of sequence
// token_seq[t] at position positions[t], head h:
//   score_p = scale · (q_lat[t, h] · c_p + rotary(q_rope[t, h]) · k_rope_p),   p <= positions[t]
//   o_lat[t, h] = sum_p softmax(score)_p · c_p                                   (KV_RANK values)
// where q_lat = W_UK_hᵀ · q_nope (the caller's batched GEMM, float32) and q_rope is read from
// q[t, h, nope:] and rotated here (interleaved pairs, cos / sin · attn_factor, rounded to bf16 as the
// cache's key). W_UV is applied to o_lat afterwards (a batched GEMM). Padded tokens (position < 0) give
// zeros. KV_RANK and ROPE_DIM are compile-time (-D; V2 / V2-Lite: 512 and 64). KV_FP8=1 (--kv-cache-dtype
// fp8): the cache rows are e4m3 bytes (mla_latent_cache_fp8), staged as bytes and widened in registers, the
// layer's kv_scale folded into the query (scores) and the output (P·C): half the bytes of a bf16 row.
// Flash-decoding, one launch: grid (head groups, S splits, T); a CTA serves `group` (<= MAX_G, chosen
// by the launcher so small batches still fill the SMs) heads of one token over one split of its context,
// in CHUNK-key steps with an online softmax (online_softmax.cuh: natural-log maxima):
//  * the chunk's latent rows go to shared memory by cp.async (16-byte pieces, all in flight at once; with
//    EARLY_CHUNK the first chunk's before pdl_wait: the step's cache rows were written by mla_latent_cache,
//    which completed before the q_lat launch this one follows; without it after the wait, where the launch
//    right before wrote them, mla_absorb.cu's mla_absorb_q_cache), the next chunk's are prefetched into L2;
//  * scores: a warp takes KPW keys, lanes across the row's bf16 pairs, each q value read once from shared
//    memory for the KPW keys, the KPW dots reduced together (sum4_scatter: 6 shuffles, not 20);
//  * P·C: a thread owns latent pairs, the chunk's weights read as float4 of 4 keys, accumulated key by key.
// With S == 1 the CTA writes bf16 o_lat; otherwise float32 partials (acc, max, sum: attention_merge's
// layout) and a ticket from counters[t·groups + group]: the last split's CTA merges them in split order
// (deterministic) and resets the counter to 0 (zero after every launch: graphs replay as is).
// Dynamic shared memory: CHUNK rows of ROW_BYTES + group·ROW float32 queries (mla_decode_smem in gpu_mla_ops).
// Roofline per token and layer: bytes = context · (KV_RANK + ROPE_DIM) · 2 (FP8: · 1) (the latent is read once per
// head group: 157 KB at 136 tokens, 4.7 MB at 4K context on V2-Lite, ~1.1 µs at 4.3 TB/s) against
// 2 · context · H · (2 · KV_RANK + ROPE_DIM) fp32 flops (150 MFLOP for 16 heads at 4K, ~2.5 µs over 132
// SMs at ~60 TFLOP/s): compute-bound on CUDA cores at long context and large batch; at batch 1 and short
// context latency-bound (q load, row load, ticket, merge: a few dependent round trips, one launch).
#include "online_softmax.cuh"
#include "kv_fp8.cuh"          // e4m3x2_to_floats

#ifndef KV_RANK
#define KV_RANK 512
#endif
#ifndef ROPE_DIM
#define ROPE_DIM 64
#endif
#ifndef KV_FP8
#define KV_FP8 0                                         // 1: e4m3 cache rows (mla_latent_cache_fp8)
#endif
#if KV_FP8
typedef unsigned char kv_t;
#else
typedef bf16_t kv_t;
#endif
#define ROW (KV_RANK + ROPE_DIM)
#define ROW_BYTES (ROW * (int)sizeof(kv_t))
#define PAIRS (ROW / 2)                                  // value pairs of a latent row
#define PPL ((PAIRS + 31) / 32)                          // pairs per lane (scores)
#define PIECE_BYTES (ROW_BYTES % 16 ? 8 : 16)            // cp.async pieces: 8 bytes where e4m3 rows need them
#define VECS (ROW_BYTES / PIECE_BYTES)                   // pieces of a row
#define PIECE (PIECE_BYTES / (int)sizeof(kv_t))          // values of a piece
#define LINES ((ROW_BYTES + 127) / 128)                  // 128-byte lines of a row (L2 prefetch)
#ifndef MAX_G
#define MAX_G 16                                         // gpu_mla_ops.MLA_MAX_GROUP
#endif
#ifndef EARLY_CHUNK
#define EARLY_CHUNK 1                                    // the first chunk's rows read before pdl_wait
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 2                                       // __launch_bounds__: 128 registers
#endif
#define MAX_SPLITS 32                                    // gpu_mla_ops.MLA_MAX_SPLITS
#define NTHREADS 256
#define NWARPS (NTHREADS / 32)
#define KPW 4                                            // keys per warp per chunk (sum4_scatter)
#define CHUNK (NWARPS * KPW)                             // gpu_mla_ops.MLA_CHUNK
#define DP ((KV_RANK / 2 + NTHREADS - 1) / NTHREADS)     // latent pairs per thread (P·C)
static_assert(ROW % 8 == 0 && KV_RANK % 8 == 0, "rows of whole 8-value pieces");
#define FULL 0xffffffffu

__device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}

// Values i and i + 1 (i even) of a staged row as floats (e4m3 ones unscaled: kv_scale is applied outside).
__device__ __forceinline__ void load_pair(const kv_t* row, int i, float& lo, float& hi) {
#if KV_FP8
    e4m3x2_to_floats(*reinterpret_cast<const unsigned short*>(row + i), lo, hi);
#else
    unpack2(*reinterpret_cast<const unsigned*>(row + i), lo, hi);
#endif
}

// The sum over the warp of v[lane >> 3] (lanes 8u..8u+7 get key u's dot): a reduce-scatter of the 4 dots.
__device__ __forceinline__ float sum4_scatter(const float v[KPW], int lane) {
    const bool hi = lane & 16, mid = lane & 8;
    float k0 = hi ? v[2] : v[0], k1 = hi ? v[3] : v[1];
    const float s0 = hi ? v[0] : v[2], s1 = hi ? v[1] : v[3];
    k0 += __shfl_xor_sync(FULL, s0, 16);
    k1 += __shfl_xor_sync(FULL, s1, 16);
    float keep = mid ? k1 : k0;
    keep += __shfl_xor_sync(FULL, mid ? k0 : k1, 8);
    keep += __shfl_xor_sync(FULL, keep, 4);
    keep += __shfl_xor_sync(FULL, keep, 2);
    keep += __shfl_xor_sync(FULL, keep, 1);
    return keep;
}

// Positions [c0, c0 + n) of the sequence's latent rows into kv_s by cp.async (rows n..CHUNK-1 zeroed).
__device__ __forceinline__ void load_chunk(kv_t* kv_s, const kv_t* cache, const int* table, int c0, int n) {
    for (int i = threadIdx.x; i < CHUNK * VECS; i += NTHREADS) {
        const int j = i / VECS, v = i % VECS, p = c0 + j;
        const bool ok = j < n;
        const size_t slot = ok ? (size_t)table[p >> 4] * 16 + (p & 15) : 0;
        if constexpr (PIECE_BYTES == 16) cp_async16(kv_s + j * ROW + v * PIECE, cache + slot * ROW + v * PIECE, ok);
        else cp_async8(kv_s + j * ROW + v * PIECE, cache + slot * ROW + v * PIECE, ok);
    }
    cp_async_commit();
}

__device__ __forceinline__ void prefetch_chunk(const kv_t* cache, const int* table, int c0, int n) {
    for (int i = threadIdx.x; i < n * LINES; i += NTHREADS) {
        const int j = i / LINES, p = c0 + j;
        const char* row = reinterpret_cast<const char*>(cache + ((size_t)table[p >> 4] * 16 + (p & 15)) * ROW);
        prefetch_l2(row + (i % LINES) * 128);
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
mla_decode_split(const float* __restrict__ q_lat, const bf16_t* __restrict__ q, int qk_dim, int nope,
                 const float* __restrict__ inv_freq, float attn_factor, const kv_t* __restrict__ cache,
                 const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ token_seq,
                 const int* __restrict__ positions, float* __restrict__ part_out, float* __restrict__ part_max,
                 float* __restrict__ part_sum, bf16_t* __restrict__ out, int* __restrict__ counters,
                 int num_heads, int group, float scale, float kv_scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    kv_t* kv_s = reinterpret_cast<kv_t*>(smem);                           // [CHUNK][ROW]
    float* q_s = reinterpret_cast<float*>(smem + CHUNK * ROW_BYTES);      // [group][ROW], pre-scaled
    __shared__ __align__(16) float p_s[MAX_G * CHUNK];
    __shared__ float m_s[MAX_G], l_s[MAX_G], alpha_s[MAX_G];
    __shared__ float weight_s[MAX_G][MAX_SPLITS];
    __shared__ int is_last;

    const int hg = blockIdx.x, split = blockIdx.y, t = blockIdx.z, groups = gridDim.x, S = gridDim.y;
    const int h0 = hg * group, G = min(group, num_heads - h0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pos = positions[t];
    const int ctx = pos + 1;                                 // 0 for padded tokens
    const int per_split = ((ctx + S - 1) / S + 15) / 16 * 16;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;
    const float q_scale = scale * kv_scale;                  // FP8: the cache's scale folded into the scores
    if (EARLY_CHUNK && start < end) load_chunk(kv_s, cache, table, start, min(CHUNK, end - start));
    pdl_begin();
    if (!EARLY_CHUNK && start < end) load_chunk(kv_s, cache, table, start, min(CHUNK, end - start));

    for (int i = tid; i < G * (KV_RANK / 4); i += NTHREADS) {
        const int g = i / (KV_RANK / 4), d = 4 * (i % (KV_RANK / 4));
        float4 v = *reinterpret_cast<const float4*>(q_lat + ((size_t)t * num_heads + h0 + g) * KV_RANK + d);
        v.x *= q_scale; v.y *= q_scale; v.z *= q_scale; v.w *= q_scale;
        *reinterpret_cast<float4*>(q_s + g * ROW + d) = v;
    }
    for (int i = tid; i < G * (ROPE_DIM / 2); i += NTHREADS) {
        const int g = i / (ROPE_DIM / 2), j = i % (ROPE_DIM / 2);
        const bf16_t* qr = q + ((size_t)t * num_heads + h0 + g) * qk_dim + nope;
        const float a = bf16_to_f(qr[2 * j]), b = bf16_to_f(qr[2 * j + 1]);
        float s, c;
        sincosf((float)pos * inv_freq[j], &s, &c);
        s *= attn_factor; c *= attn_factor;
        q_s[g * ROW + KV_RANK + 2 * j] = round_bf16(a * c - b * s) * q_scale;
        q_s[g * ROW + KV_RANK + 2 * j + 1] = round_bf16(a * s + b * c) * q_scale;
    }
    if (tid < MAX_G) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
    float acc[DP][2][MAX_G];
    #pragma unroll
    for (int a = 0; a < DP; ++a)
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) acc[a][0][g] = acc[a][1][g] = 0.f;
    __syncthreads();                                         // m_s, l_s (an empty split reads them next)

    for (int c0 = start; c0 < end; c0 += CHUNK) {
        const int n = min(CHUNK, end - c0);
        if (c0 != start) load_chunk(kv_s, cache, table, c0, n);
        cp_async_wait<0>();
        __syncthreads();                                     // the chunk's rows
        if (c0 + CHUNK < end) prefetch_chunk(cache, table, c0 + CHUNK, min(CHUNK, end - c0 - CHUNK));
        // 1. scores of keys j0..j0+KPW-1 (p_s = 0 past n: those rows are zeros and weigh nothing).
        const int j0 = warp * KPW;
        if (j0 < n) {
            float kr[KPW][2 * PPL];
            #pragma unroll
            for (int u = 0; u < KPW; ++u)
                #pragma unroll
                for (int e = 0; e < PPL; ++e) {
                    const int pi = lane + 32 * e;
                    kr[u][2 * e] = kr[u][2 * e + 1] = 0.f;
                    if (pi < PAIRS) load_pair(kv_s + (j0 + u) * ROW, 2 * pi, kr[u][2 * e], kr[u][2 * e + 1]);
                }
            #pragma unroll 1
            for (int g = 0; g < G; ++g) {
                const float2* qg = reinterpret_cast<const float2*>(q_s + g * ROW);
                float dot[KPW];
                #pragma unroll
                for (int u = 0; u < KPW; ++u) dot[u] = 0.f;
                #pragma unroll
                for (int e = 0; e < PPL; ++e) {
                    const int pi = lane + 32 * e;
                    if (pi < PAIRS) {
                        const float2 qv = qg[pi];
                        #pragma unroll
                        for (int u = 0; u < KPW; ++u)
                            dot[u] = fmaf(qv.y, kr[u][2 * e + 1], fmaf(qv.x, kr[u][2 * e], dot[u]));
                    }
                }
                const float s = sum4_scatter(dot, lane);
                const int j = j0 + (lane >> 3);
                if ((lane & 7) == 0) p_s[g * CHUNK + j] = j < n ? s : 0.f;
            }
        }
        __syncthreads();
        // 2. online softmax update, one warp per head.
        online_softmax_chunk(p_s, m_s, l_s, alpha_s, G, n, CHUNK, NWARPS);
        __syncthreads();
        // 3. acc = acc·alpha + P·C, a thread per latent pair, keys in order.
        const int n4 = (n + 3) & ~3;
        #pragma unroll
        for (int a = 0; a < DP; ++a) {
            const int pr = tid + a * NTHREADS;
            if (pr >= KV_RANK / 2) continue;
            #pragma unroll
            for (int g = 0; g < MAX_G; ++g)
                if (g < G) { acc[a][0][g] *= alpha_s[g]; acc[a][1][g] *= alpha_s[g]; }
            #pragma unroll 1
            for (int j = 0; j < n4; j += 4) {
                float v[4][2];
                #pragma unroll
                for (int u = 0; u < 4; ++u)
                    load_pair(kv_s + (j + u) * ROW, 2 * pr, v[u][0], v[u][1]);
                #pragma unroll
                for (int g = 0; g < MAX_G; ++g) {
                    if (g < G) {
                        const float4 p = *reinterpret_cast<const float4*>(p_s + g * CHUNK + j);
                        #pragma unroll
                        for (int c = 0; c < 2; ++c)
                            acc[a][c][g] = fmaf(p.w, v[3][c], fmaf(p.z, v[2][c], fmaf(p.y, v[1][c],
                                                fmaf(p.x, v[0][c], acc[a][c][g]))));
                    }
                }
            }
        }
        __syncthreads();                                     // kv_s and p_s free for the next chunk
    }

    const size_t head0 = (size_t)t * num_heads + h0;
    #pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
        if (g >= G) break;
        const size_t th = head0 + g;
        #pragma unroll
        for (int a = 0; a < DP; ++a) {
            const int pr = tid + a * NTHREADS;
            if (pr >= KV_RANK / 2) continue;
            if (S == 1) {
                const float l = l_s[g];
                const float lo = l > 0.f ? acc[a][0][g] / l * kv_scale : 0.f, hi = l > 0.f ? acc[a][1][g] / l * kv_scale : 0.f;
                *reinterpret_cast<unsigned*>(out + th * KV_RANK + 2 * pr) = f_to_bf16(lo) | ((unsigned)f_to_bf16(hi) << 16);
            } else {
                *reinterpret_cast<float2*>(part_out + (th * S + split) * KV_RANK + 2 * pr) =
                    make_float2(acc[a][0][g] * kv_scale, acc[a][1][g] * kv_scale);
            }
        }
        if (S > 1 && tid == 0) { part_max[th * S + split] = m_s[g]; part_sum[th * S + split] = l_s[g]; }
    }
    if (S == 1) return;
    __threadfence();                                         // this CTA's partials, visible before its ticket
    __syncthreads();
    int* counter = counters + (size_t)t * groups + hg;
    if (tid == 0) is_last = atomicAdd(counter, 1) == S - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // The last CTA: per head, the splits' weights e^(m_s − m) / Σ e^(m_s − m)·l_s (one warp per head) ...
    for (int g = warp; g < G; g += NWARPS) {
        const size_t rows = (head0 + g) * S;
        split_weights(part_max + rows, part_sum + rows, S, weight_s[g], lane);
    }
    __syncthreads();
    // ... then o = Σ_s weight_s · acc_s over the non-empty splits (the first `live`), in split order.
    const int live = per_split > 0 ? min(S, (ctx + per_split - 1) / per_split) : 0;
    for (int i = tid; i < G * (KV_RANK / 2); i += NTHREADS) {
        const int g = i / (KV_RANK / 2), pr = i % (KV_RANK / 2);
        const size_t th = head0 + g;
        const float* src = part_out + th * S * KV_RANK + 2 * pr;
        float lo = 0.f, hi = 0.f;
        #pragma unroll 4
        for (int sp = 0; sp < live; ++sp) {
            const float2 x = __ldcg(reinterpret_cast<const float2*>(src + (size_t)sp * KV_RANK));
            lo = fmaf(x.x, weight_s[g][sp], lo);
            hi = fmaf(x.y, weight_s[g][sp], hi);
        }
        *reinterpret_cast<unsigned*>(out + th * KV_RANK + 2 * pr) = f_to_bf16(lo) | ((unsigned)f_to_bf16(hi) << 16);
    }
    if (tid == 0) *counter = 0;
}
