// MLA attention in the absorbed form (DeepSeek-V2 decode), over the paged latent cache
// cache[slot] = [c (KV_RANK) | k_rope (ROPE_DIM)] (mla_latent_cache.cu). Query token t of sequence
// token_seq[t] at position positions[t], head h:
//   score_p = scale · (q_lat[t, h] · c_p + rotary(q_rope[t, h]) · k_rope_p),   p <= positions[t]
//   o_lat[t, h] = sum_p softmax(score)_p · c_p                                   (KV_RANK values)
// where q_lat = W_UK_hᵀ · q_nope (the caller's batched GEMM, float32) and q_rope is read from
// q[t, h, nope:] and rotated here (interleaved pairs, cos / sin · attn_factor, rounded to bf16 as the
// cache's key). W_UV is applied to o_lat afterwards (a batched GEMM). Flash-decoding: grid (S, head
// groups of MAX_G, T); a CTA walks one split of the context in CHUNK-key steps with an online softmax,
// reading each latent row once for all its heads (one warp per key for the scores, threads across
// KV_RANK for the accumulation). With S == 1 it writes bf16 o_lat itself; otherwise float32 partials
// that paged_attention.cu's attention_merge combines (D = KV_RANK). Padded tokens (position < 0)
// give zeros. KV_RANK and ROPE_DIM are compile-time (-D; V2 / V2-Lite: 512 and 64).
// Roofline per token and layer: bytes = context · (KV_RANK + ROPE_DIM) · 2 (the latent is read once for
// all heads: 4.7 MB at 4K context on V2-Lite, ~1.1 µs at 4.3 TB/s) against 2 · context · H ·
// (2 · KV_RANK + ROPE_DIM) fp32 FMA flops (150 MFLOP for 16 heads, ~2.5 µs over 132 SMs at ~60 TFLOP/s
// of fp32): compute-bound on CUDA cores; a tensor-core (mma) version is the next step.
#include "online_softmax.cuh"

#ifndef KV_RANK
#define KV_RANK 512
#endif
#ifndef ROPE_DIM
#define ROPE_DIM 64
#endif
#define ROW (KV_RANK + ROPE_DIM)
#define MAX_G 16
#define CHUNK 64
#define NTHREADS 256
#define NWARPS (NTHREADS / 32)
#define PER_LANE ((ROW + 31) / 32)
#define DPT ((KV_RANK + NTHREADS - 1) / NTHREADS)

extern "C" __global__ void __launch_bounds__(NTHREADS)
mla_decode_split(const float* __restrict__ q_lat, const bf16_t* __restrict__ q, int qk_dim, int nope,
                 const float* __restrict__ inv_freq, float attn_factor, const bf16_t* __restrict__ cache,
                 const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ token_seq,
                 const int* __restrict__ positions, float* __restrict__ part_out, float* __restrict__ part_max,
                 float* __restrict__ part_sum, bf16_t* __restrict__ out, int num_heads, float scale) {
    pdl_begin();
    __shared__ float q_s[MAX_G * ROW];
    __shared__ float p_s[MAX_G * CHUNK];
    __shared__ int slot_s[CHUNK];
    __shared__ float m_s[MAX_G], l_s[MAX_G], alpha_s[MAX_G];

    const int split = blockIdx.x, h0 = blockIdx.y * MAX_G, t = blockIdx.z, S = gridDim.x;
    const int G = min(MAX_G, num_heads - h0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pos = positions[t];
    const int ctx = pos + 1;                                 // 0 for padded tokens
    const int per_split = ((ctx + S - 1) / S + 15) / 16 * 16;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;

    for (int i = tid; i < G * KV_RANK; i += NTHREADS) {
        const int g = i / KV_RANK, d = i % KV_RANK;
        q_s[g * ROW + d] = q_lat[((size_t)t * num_heads + h0 + g) * KV_RANK + d] * scale;
    }
    for (int i = tid; i < G * (ROPE_DIM / 2); i += NTHREADS) {
        const int g = i / (ROPE_DIM / 2), j = i % (ROPE_DIM / 2);
        const bf16_t* qr = q + ((size_t)t * num_heads + h0 + g) * qk_dim + nope;
        const float a = bf16_to_f(qr[2 * j]), b = bf16_to_f(qr[2 * j + 1]);
        float s, c;
        sincosf((float)pos * inv_freq[j], &s, &c);
        s *= attn_factor; c *= attn_factor;
        q_s[g * ROW + KV_RANK + 2 * j] = round_bf16(a * c - b * s) * scale;
        q_s[g * ROW + KV_RANK + 2 * j + 1] = round_bf16(a * s + b * c) * scale;
    }
    if (tid < MAX_G) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
    float acc[DPT][MAX_G];
    #pragma unroll
    for (int a = 0; a < DPT; ++a)
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) acc[a][g] = 0.f;
    __syncthreads();

    for (int c0 = start; c0 < end; c0 += CHUNK) {
        const int n = min(CHUNK, end - c0);
        // 1. scores: one warp per key, lanes across the latent row and the rope key.
        for (int j = warp; j < n; j += NWARPS) {
            const int p = c0 + j;
            const int slot = table[p >> 4] * 16 + (p & 15);
            if (lane == 0) slot_s[j] = slot;
            const bf16_t* kp = cache + (size_t)slot * ROW;
            float kr[PER_LANE];
            #pragma unroll
            for (int e = 0; e < PER_LANE; ++e) kr[e] = lane + 32 * e < ROW ? bf16_to_f(kp[lane + 32 * e]) : 0.f;
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
                #pragma unroll
                for (int e = 0; e < PER_LANE; ++e)
                    if (lane + 32 * e < ROW) dot += q_s[g * ROW + lane + 32 * e] * kr[e];
                dot = warp_sum(dot);
                if (lane == 0) p_s[g * CHUNK + j] = dot;
            }
        }
        __syncthreads();
        // 2. online softmax update, one warp per head (online_softmax.cuh).
        online_softmax_chunk(p_s, m_s, l_s, alpha_s, G, n, CHUNK, NWARPS);
        __syncthreads();
        // 3. acc = acc·alpha + P·C, threads across the latent.
        #pragma unroll
        for (int a = 0; a < DPT; ++a) {
            const int d = tid + a * NTHREADS;
            if (d >= KV_RANK) continue;
            #pragma unroll
            for (int g = 0; g < MAX_G; ++g) if (g < G) acc[a][g] *= alpha_s[g];
            for (int j = 0; j < n; ++j) {
                const float v = bf16_to_f(cache[(size_t)slot_s[j] * ROW + d]);
                #pragma unroll
                for (int g = 0; g < MAX_G; ++g) if (g < G) acc[a][g] += p_s[g * CHUNK + j] * v;
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
        if (g >= G) break;
        const size_t th = (size_t)t * num_heads + h0 + g;
        #pragma unroll
        for (int a = 0; a < DPT; ++a) {
            const int d = tid + a * NTHREADS;
            if (d >= KV_RANK) continue;
            if (S == 1) out[th * KV_RANK + d] = f_to_bf16(l_s[g] > 0.f ? acc[a][g] / l_s[g] : 0.f);
            else part_out[(th * S + split) * KV_RANK + d] = acc[a][g];
        }
        if (S > 1 && tid == 0) { part_max[th * S + split] = m_s[g]; part_sum[th * S + split] = l_s[g]; }
    }
}
