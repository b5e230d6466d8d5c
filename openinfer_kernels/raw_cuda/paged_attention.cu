// Paged attention (flash-decoding), GQA-aware, for decode and prefill alike.
// Query token t (of sequence token_seq[t], at position positions[t]) attends causally to KV positions
// [0, positions[t]] of its sequence, read through the block table (16-token blocks; slot = table[p/16]·16 + p%16).
// Grid (num_splits, Hkv, T): each block takes one KV head and its G = Hq/Hkv query heads (K/V read once
// per group) over one contiguous split of the context, walking it in 256-token chunks with an online
// softmax; `attention_merge` combines the splits and writes bf16 o[t, h·D + d].
// Padded tokens (positions[t] < 0) produce zeros. Scores and accumulation are fp32.
// Roofline (decode): bytes = context·Hkv·D·2·2 per sequence (K and V once), flops ≈ 4·context·Hq·D: at
// 4.3 TB/s a 4K-token Qwen3-4B context (8 KV heads, D 128) is 16 MB per layer... i.e. 0.5 MB/layer for 128
// tokens, ~0.12 µs: launch-bound at short context, bandwidth-bound at long context (split over KV so
// 132 SMs share one sequence).
#include "online_softmax.cuh"

#define MAX_G 16
#define MAX_D 256
#define CHUNK 256
#define NTHREADS 128
#define DPT (MAX_D / NTHREADS)

extern "C" __global__ void __launch_bounds__(NTHREADS)
paged_attention_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
                      const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
                      const int* __restrict__ token_seq, const int* __restrict__ positions,
                      float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
                      int num_heads, int num_kv_heads, int D, float scale) {
    pdl_begin();
    __shared__ float q_s[MAX_G * MAX_D];
    __shared__ float p_s[MAX_G * CHUNK];
    __shared__ int slot_s[CHUNK];
    __shared__ float m_s[MAX_G], l_s[MAX_G], alpha_s[MAX_G];

    const int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z, S = gridDim.x;
    const int G = num_heads / num_kv_heads;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = NTHREADS / 32;
    const int ctx = positions[t] + 1;                       // 0 for padded tokens
    const int per_split = ((ctx + S - 1) / S + 15) / 16 * 16;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;

    const bf16_t* qg = q + ((size_t)t * num_heads + kvh * G) * D;   // the group's heads are contiguous
    for (int i = tid; i < G * D; i += NTHREADS) q_s[i] = bf16_to_f(qg[i]) * scale;
    if (tid < G) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
    float acc[DPT][MAX_G];
    #pragma unroll
    for (int a = 0; a < DPT; ++a)
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) acc[a][g] = 0.f;
    __syncthreads();

    for (int c0 = start; c0 < end; c0 += CHUNK) {
        const int n = min(CHUNK, end - c0);
        // 1. scores: one warp per key, lanes across D.
        for (int j = warp; j < n; j += nwarps) {
            const int p = c0 + j;
            const int slot = table[p >> 4] * 16 + (p & 15);
            if (lane == 0) slot_s[j] = slot;
            const bf16_t* kp = k_cache + ((size_t)slot * num_kv_heads + kvh) * D;
            float kr[MAX_D / 32];
            #pragma unroll
            for (int e = 0; e < MAX_D / 32; ++e) kr[e] = (lane + 32 * e < D) ? bf16_to_f(kp[lane + 32 * e]) : 0.f;
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
                #pragma unroll
                for (int e = 0; e < MAX_D / 32; ++e)
                    if (lane + 32 * e < D) dot += q_s[g * D + lane + 32 * e] * kr[e];
                dot = warp_sum(dot);
                if (lane == 0) p_s[g * CHUNK + j] = dot;
            }
        }
        __syncthreads();
        // 2. online softmax update, one warp per head (online_softmax.cuh).
        online_softmax_chunk(p_s, m_s, l_s, alpha_s, G, n, CHUNK, nwarps);
        __syncthreads();
        // 3. acc = acc·alpha + P·V, threads across D.
        #pragma unroll
        for (int a = 0; a < DPT; ++a) {
            const int d = tid + a * NTHREADS;
            if (d >= D) continue;
            #pragma unroll
            for (int g = 0; g < MAX_G; ++g) if (g < G) acc[a][g] *= alpha_s[g];
            for (int j = 0; j < n; ++j) {
                const float v = bf16_to_f(v_cache[((size_t)slot_s[j] * num_kv_heads + kvh) * D + d]);
                #pragma unroll
                for (int g = 0; g < MAX_G; ++g) if (g < G) acc[a][g] += p_s[g * CHUNK + j] * v;
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
        if (g >= G) break;
        const size_t row = ((size_t)t * num_heads + kvh * G + g) * S + split;
        #pragma unroll
        for (int a = 0; a < DPT; ++a) {
            const int d = tid + a * NTHREADS;
            if (d < D) part_out[row * D + d] = acc[a][g];
        }
        if (tid == 0) { part_max[row] = m_s[g]; part_sum[row] = l_s[g]; }
    }
}

// Merge the splits: o[t, h·D + d] = Σ_s e^(m_s − m)·out_s[d] / Σ_s e^(m_s − m)·l_s.  Grid (T·Hq), NTHREADS.
extern "C" __global__ void __launch_bounds__(NTHREADS)
attention_merge(const float* __restrict__ part_out, const float* __restrict__ part_max,
                const float* __restrict__ part_sum, bf16_t* __restrict__ out, int num_splits, int D) {
    pdl_begin();
    const size_t th = blockIdx.x;                      // t·Hq + h
    const float* pm = part_max + th * num_splits;
    const float* pl = part_sum + th * num_splits;
    float m = -INFINITY;
    for (int s = 0; s < num_splits; ++s) if (pl[s] > 0.f) m = fmaxf(m, pm[s]);
    float denom = 0.f;
    for (int s = 0; s < num_splits; ++s) if (pl[s] > 0.f) denom += pl[s] * expf(pm[s] - m);
    for (int d = threadIdx.x; d < D; d += NTHREADS) {
        float o = 0.f;
        for (int s = 0; s < num_splits; ++s)
            if (pl[s] > 0.f) o += part_out[(th * num_splits + s) * D + d] * expf(pm[s] - m);
        out[th * D + d] = f_to_bf16(denom > 0.f ? o / denom : 0.f);
    }
}
