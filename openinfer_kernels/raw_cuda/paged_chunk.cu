// Paged attention for short query runs on tensor cores: the few new tokens of one sequence (a prefix
// hit's recomputed block, a short chunk) against its whole paged context, split over the keys.
// Query token t of a tile (tiles[i] = {first row t0, n ≤ QT rows}, all of one sequence, positions
// ascending) attends to KV positions [0, positions[t]] of sequence token_seq[t0] through the 16-token
// block table. Compiled per (GQA, HEAD_DIM) with -D options; HEAD_DIM a multiple of 16, at most 128.
//  * A CTA (4 warps) takes one tile, one KV head and one split: its M = 64 query rows are the tile's
//    QT = 64 / GQA tokens × the GQA query heads of the KV head (row m: token m / GQA, head m % GQA),
//    16 rows a warp, so the K and V rows it stages serve every query head of the group at once.
//  * Keys go through shared memory in tiles of BN = 32 (cp.async, two stages: tile i + 1 loads while
//    tile i is scored); S = Q·Kᵀ and O += P·V run as mma.m16n8k16 bf16 with fp32 accumulation
//    (mma.cuh; V's fragments by ldmatrix.trans), the online softmax in the log2 domain on the S
//    fragments (P rounded to bf16 for the product, as FlashAttention does).
//  * num_splits == 1: the CTA writes bf16 o itself. Otherwise it writes its fp32 partial (unnormalized
//    acc, running max in log2 units, sum) at row ((i·QT + j)·Hq + h)·S + split of part_out / part_max /
//    part_sum, and paged_chunk_merge (grid tiles × Hkv) combines the splits.
// Roofline (a 16-token hit at context C, Qwen3-4B: Hkv 8, D 128): the K and V bytes C·Hkv·D·2·2 per layer
// once (16k: 67 MB, 16 µs at 4.3 TB/s; the CUDA-core decode kernel walks them once per query row) and
// 4·C·16·Hq·D flops (8.6 GFLOP at 16k, ~15 µs of mma.sync). Measured on the H200 at 16k: ~50 µs a layer
// with the merge (bench/results/chunk-attention.md): each CTA's walk of ~10 tiles is latency-bound.
#include "common.cuh"
#include "mma.cuh"
#include "attention_shape.cuh"   // GQA, HEAD_DIM, WARPS, NTHREADS
#define ROWS 64                                  // query rows per CTA (QT tokens x GQA heads)
#define QT (ROWS / GQA)
#define BN 32                                    // keys per shared-memory tile
#define LDS (HEAD_DIM + 8)                       // bf16 row pitch: fragment reads bank-conflict free
#define DV (HEAD_DIM / 8)                        // 16-byte pieces per K or V row
#define KT (HEAD_DIM / 16)                       // k steps of Q·Kᵀ
#define NT (HEAD_DIM / 8)                        // n tiles of P·V
#define LOG2E 1.4426950408889634f
#define CTAS_PER_SM 3                            // gpu_chunk.CTAS_PER_SM: the splits fill one wave of these
static_assert(ROWS % GQA == 0 && HEAD_DIM % 16 == 0 && HEAD_DIM <= 128, "GQA divides 64, HEAD_DIM % 16 == 0");

extern "C" __global__ void __launch_bounds__(NTHREADS, CTAS_PER_SM)
paged_chunk_attention(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
                      const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
                      const int* __restrict__ token_seq, const int* __restrict__ positions,
                      const int* __restrict__ tiles, float* __restrict__ part_out, float* __restrict__ part_max,
                      float* __restrict__ part_sum, bf16_t* __restrict__ out, int num_kv_heads, float scale) {
    __shared__ __align__(16) bf16_t k_s[2][BN * LDS];
    __shared__ __align__(16) bf16_t v_s[2][BN * LDS];
    __shared__ int pos_s[ROWS];
    __shared__ int ctx_s;

    const int tile = blockIdx.x, split = blockIdx.y, kvh = blockIdx.z, S = gridDim.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int num_heads = num_kv_heads * GQA;
    pdl_wait();
    const int t0 = tiles[2 * tile], n = tiles[2 * tile + 1];
    if (tid < ROWS) pos_s[tid] = tid / GQA < n ? positions[t0 + tid / GQA] : -1;
    if (tid == 0) {
        int c = 0;
        for (int j = 0; j < n; ++j) c = max(c, positions[t0 + j] + 1);
        ctx_s = c;
    }
    __syncthreads();
    pdl_launch_dependents();
    const int ctx = ctx_s;
    const int per_split = ((ctx + S - 1) / S + BN - 1) / BN * BN;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (size_t)token_seq[t0] * max_blocks;
    const size_t row_stride = (size_t)num_kv_heads * HEAD_DIM;
    const bf16_t* kbase = k_cache + (size_t)kvh * HEAD_DIM;
    const bf16_t* vbase = v_cache + (size_t)kvh * HEAD_DIM;

    // This warp's rows r0 = 16·warp + g and r1 = r0 + 8: their positions and Q fragments (registers).
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const int pos0 = pos_s[r0], pos1 = pos_s[r1];
    const bool warp_live = pos_s[warp * 16] >= 0;           // rows fill from the top: a warp's first row
    unsigned qa[KT][4];
    {
        const bf16_t* q0 = q + ((size_t)(t0 + r0 / GQA) * num_heads + kvh * GQA + r0 % GQA) * HEAD_DIM;
        const bf16_t* q1 = q + ((size_t)(t0 + r1 / GQA) * num_heads + kvh * GQA + r1 % GQA) * HEAD_DIM;
        #pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            const int d = 16 * kk + 2 * t4;
            qa[kk][0] = pos0 >= 0 ? *reinterpret_cast<const unsigned*>(q0 + d) : 0u;
            qa[kk][1] = pos1 >= 0 ? *reinterpret_cast<const unsigned*>(q1 + d) : 0u;
            qa[kk][2] = pos0 >= 0 ? *reinterpret_cast<const unsigned*>(q0 + d + 8) : 0u;
            qa[kk][3] = pos1 >= 0 ? *reinterpret_cast<const unsigned*>(q1 + d + 8) : 0u;
        }
    }
    float o[NT][4];
    #pragma unroll
    for (int i = 0; i < NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const float scale_log2 = scale * LOG2E;

    // K and V rows [k0, k0 + BN) of this KV head into stage st (zeros past `end`).
    auto load_tile = [&](int st, int k0) {
        #pragma unroll
        for (int i = tid; i < 2 * BN * DV; i += NTHREADS) {
            const int which = i / (BN * DV), r = (i / DV) % BN, c = i % DV, p = k0 + r;
            const bool valid = p < end;
            const size_t slot = valid ? (size_t)table[p >> 4] * 16 + (p & 15) : 0;
            const bf16_t* src = (which ? vbase : kbase) + slot * row_stride + c * 8;
            cp_async16((which ? v_s[st] : k_s[st]) + r * LDS + c * 8, src, valid);
        }
        cp_async_commit();
    };

    const int num_tiles = end > start ? (end - start + BN - 1) / BN : 0;
    if (num_tiles > 0) load_tile(0, start);
    for (int it = 0; it < num_tiles; ++it) {
        const int st = it & 1, k0 = start + it * BN;
        if (it + 1 < num_tiles) {
            load_tile(st ^ 1, k0 + BN);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (warp_live) {
            // S = Q·Kᵀ for 16 rows x BN keys: BN/8 n tiles.
            float s[BN / 8][4];
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < KT; ++kk)
                #pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const bf16_t* kp = k_s[st] + (8 * j + g) * LDS + 16 * kk + 2 * t4;
                    mma_16816(s[j], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                              *reinterpret_cast<const unsigned*>(kp), *reinterpret_cast<const unsigned*>(kp + 8));
                }
            // Mask (causal, and keys past the split) and the tile's row maxima.
            float mx0 = -INFINITY, mx1 = -INFINITY;
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j)
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int p = k0 + 8 * j + 2 * t4 + e;
                    s[j][e] = (p <= pos0 && p < end) ? s[j][e] * scale_log2 : -INFINITY;
                    s[j][2 + e] = (p <= pos1 && p < end) ? s[j][2 + e] * scale_log2 : -INFINITY;
                    mx0 = fmaxf(mx0, s[j][e]);
                    mx1 = fmaxf(mx1, s[j][2 + e]);
                }
            #pragma unroll
            for (int o_ = 1; o_ < 4; o_ <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
            }
            const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
            const float base0 = new0 == -INFINITY ? 0.f : new0, base1 = new1 == -INFINITY ? 0.f : new1;
            const float alpha0 = exp2f(m0 - base0), alpha1 = exp2f(m1 - base1);
            m0 = new0;
            m1 = new1;
            // P (bf16, as the product takes it) and its row sums.
            unsigned pa[BN / 16][4];
            float sum0 = 0.f, sum1 = 0.f;
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const float p00 = round_bf16(exp2f(s[j][0] - base0)), p01 = round_bf16(exp2f(s[j][1] - base0));
                const float p10 = round_bf16(exp2f(s[j][2] - base1)), p11 = round_bf16(exp2f(s[j][3] - base1));
                sum0 += p00 + p01;
                sum1 += p10 + p11;
                pa[j >> 1][(j & 1) * 2] = pack_bf16(p00, p01);         // rows g: a0 (even j), a2 (odd j)
                pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16(p10, p11);     // rows g + 8: a1, a3
            }
            l0 = l0 * alpha0 + sum0;
            l1 = l1 * alpha1 + sum1;
            #pragma unroll
            for (int i = 0; i < NT; ++i) {
                o[i][0] *= alpha0; o[i][1] *= alpha0;
                o[i][2] *= alpha1; o[i][3] *= alpha1;
            }
            // O += P·V: B[k = key][n = d], two n tiles per ldmatrix (tiles: keys +0 / +8 x columns +0 / +8).
            #pragma unroll
            for (int ks = 0; ks < BN / 16; ++ks) {
                const bf16_t* vp = v_s[st] + (16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;
                #pragma unroll
                for (int i = 0; i < NT; i += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, vp + 8 * i);
                    mma_16816(o[i], pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3], b[0], b[1]);
                    mma_16816(o[i + 1], pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3], b[2], b[3]);
                }
            }
        }
        __syncthreads();                       // stage st is free for tile it + 2
    }

    // Row sums over the quad (the 4 lanes of a row), then the output or the partial.
    #pragma unroll
    for (int o_ = 1; o_ < 4; o_ <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o_);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o_);
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = h ? r1 : r0;
        if ((h ? pos1 : pos0) < 0) continue;
        const int j = r / GQA, head = kvh * GQA + r % GQA;
        const float l = h ? l1 : l0, m = h ? m1 : m0;
        if (S == 1) {
            const float inv = l > 0.f ? 1.f / l : 0.f;
            bf16_t* dst = out + ((size_t)(t0 + j) * num_heads + head) * HEAD_DIM + 2 * t4;
            #pragma unroll
            for (int i = 0; i < NT; ++i)
                *reinterpret_cast<unsigned*>(dst + 8 * i) = pack_bf16(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
        } else {
            const size_t prow = ((size_t)(tile * QT + j) * num_heads + head) * S + split;
            float* dst = part_out + prow * HEAD_DIM + 2 * t4;
            #pragma unroll
            for (int i = 0; i < NT; ++i)
                *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[i][2 * h], o[i][2 * h + 1]);
            if (t4 == 0) { part_max[prow] = m; part_sum[prow] = l; }
        }
    }
}

// The splits of paged_chunk_attention combined: o = Σ_s 2^(m_s − M)·acc_s / Σ_s 2^(m_s − M)·l_s over the
// splits that saw a key (l_s > 0). Grid (tiles · QT, Hq): one CTA per query row and head (rows past a
// tile's n exit); the first warp turns the S maxima and sums into weights in shared memory, then each
// thread sums its columns over the splits (independent, coalesced loads). Roofline: S·D·4 bytes a row.
extern "C" __global__ void __launch_bounds__(NTHREADS)
paged_chunk_merge(const int* __restrict__ tiles, const float* __restrict__ part_out,
                  const float* __restrict__ part_max, const float* __restrict__ part_sum, bf16_t* __restrict__ out,
                  int num_kv_heads, int num_splits) {
    __shared__ float w_s[64];                     // gpu_chunk.MAX_CHUNK_SPLITS
    pdl_begin();
    const int tile = blockIdx.x / QT, j = blockIdx.x % QT, head = blockIdx.y, S = num_splits;
    const int t0 = tiles[2 * tile], n = tiles[2 * tile + 1], num_heads = num_kv_heads * GQA;
    if (j >= n) return;
    const size_t prow = ((size_t)(tile * QT + j) * num_heads + head) * S;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float m = -INFINITY;
        for (int s = lane; s < S; s += 32) if (part_sum[prow + s] > 0.f) m = fmaxf(m, part_max[prow + s]);
        m = warp_max(m);
        float denom = 0.f;
        for (int s = lane; s < S; s += 32) {
            const float w = part_sum[prow + s] > 0.f ? exp2f(part_max[prow + s] - m) : 0.f;
            w_s[s] = w;
            denom += w * part_sum[prow + s];
        }
        denom = warp_sum(denom);
        const float inv = denom > 0.f ? 1.f / denom : 0.f;
        __syncwarp();
        for (int s = lane; s < S; s += 32) w_s[s] *= inv;
    }
    __syncthreads();
    bf16_t* dst = out + ((size_t)(t0 + j) * num_heads + head) * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += NTHREADS) {
        float acc = 0.f;
        #pragma unroll 8
        for (int s = 0; s < S; ++s) acc += part_out[(prow + s) * HEAD_DIM + d] * w_s[s];
        dst[d] = f_to_bf16(acc);
    }
}
