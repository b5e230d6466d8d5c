// DeepSeek-V4's decode attention over the paged rows (engine/executor/cpu_dsv4_attention.py dsv4_attention with
// one query per sequence; cpu_dsv4_ops.sink_attention): query row t at position p (-1: padding, zeros out), head
// h, attends with scale to one shared K = V head of d values over
//   * its sliding window: the rows at positions max(0, p - window + 1) .. p (column 0 of the layer's rows);
//   * the compressed entries it may see (rate > 0): with `topk` > 0 (CSA) the entries ids[t, :topk] the
//     lightning indexer picked (-1: none), else (HCA) every closed entry e < (p + 1) / rate; entry e sits in the
//     row of its window's last token, position (e + 1) · rate - 1, at column entry_col;
// and its learned sink s_h takes part in the softmax's denominator only:
//   o = sum_j exp(l_j - m) v_j / (sum_j exp(l_j - m) + exp(s_h - m)),  l_j = scale · q · k_j,  m = max(l, s_h).
// Fixed grid and no host reads (graph-capturable): a row's keys are found on the device from its position, its
// block table and the indexer's ids; every bound is an argument.
//
// The rows are the layer's bf16 [slots, row_width], read through tables [T, max_blocks] (row t: token t's
// sequence's blocks) as rows_at does. One CTA per (row, group of ATT_G heads), ATT_WARPS warps. The CTA first
// resolves up to ATT_CHUNK keys' slots into shared memory (the ids -> block table -> slot chain, every key's at
// once), then warp w takes keys w·U .. w·U + U - 1, then U·ATT_WARPS further, ..: the U keys' rows are loaded
// together (8 bytes a lane a piece of 128 values: ATT_PIECES = ceil(d / 128) pieces), each scored against the
// group's ATT_G queries, and folded into the warp's online softmax (max, sum, accumulator per head). The warps'
// partials merge in shared memory in warp order, with the sink. d <= 1024, d % 4 == 0 (the line's start check).
//
// Roofline per row: (window + keys) · d · 2 bytes of K = V from DRAM (V4-Flash, window 128 + top-k 512 of 512
// values: 655 KB a CSA layer, 128 + context/128 entries an HCA one), ~0.2 µs at 3 TB/s; the head groups' CTAs read
// the same keys again from L2 (one KV head): heads / ATT_G times those bytes. The first form (a CTA per head, its
// warps' key loads one after another, each behind its ids and block-table reads) took 66 µs a CSA layer at batch 1
// on an H100 (ncu, 2026-12-07): latency-bound. ATT_G trades CTAs for L2 reads: attention_grid.sparse_heads_per_cta
// takes 1 head a CTA until rows · heads CTAs fill the SMs twice, larger groups past that (64 heads: 2 from batch 9,
// 4 from batch 17).
#include "common.cuh"
#include "dsv4_keys.cuh"

#ifndef ATT_G
#define ATT_G 1                           // heads a CTA (their queries share each key's load)
#endif
#ifndef ATT_PIECES
#define ATT_PIECES 8                      // ceil(d / 128): a lane's 4-value pieces of a row
#endif
#define ATT_WARPS 8
#define ATT_THREADS (32 * ATT_WARPS)
// keys a warp loads together: what ~80 registers hold beside the accumulators (ATT_G · ATT_PIECES <= 16)
#define ATT_U_FIT ((80 - 4 * ATT_G * ATT_PIECES) / (2 * ATT_PIECES))
#define ATT_U (ATT_U_FIT > 4 ? 4 : ATT_U_FIT < 1 ? 1 : ATT_U_FIT)
#define ATT_CHUNK 1024                    // keys whose slots a CTA resolves at a time
#define ATT_D (128 * ATT_PIECES)


// 4 bf16 (8 bytes, the lower half first) as float32.
__device__ __forceinline__ void bf16x4_to_f(uint2 w, float (&f)[4]) {
    f[0] = __uint_as_float(w.x << 16), f[1] = __uint_as_float(w.x & 0xFFFF0000u);
    f[2] = __uint_as_float(w.y << 16), f[3] = __uint_as_float(w.y & 0xFFFF0000u);
}

// The warp's ATT_U keys from key j0 of the chunk (slot -1 or past count: none, ok false): rows loaded, scored
// against the group's queries (s: scale · q · k), folded into the warp's online softmax.
__device__ __forceinline__ void att_keys(const bf16_t* __restrict__ kv, const int* slots, int j0, int count, int base,
                                         int window, int row_width, int entry_col, int d, float scale,
                                         const float (&qs)[ATT_G][ATT_D], float (&m)[ATT_G], float (&l)[ATT_G],
                                         float (&acc)[ATT_G][ATT_PIECES][4]) {
    const int lane = threadIdx.x & 31;
    uint2 kr[ATT_U][ATT_PIECES];
    bool ok[ATT_U];
    #pragma unroll
    for (int u = 0; u < ATT_U; ++u) {
        const int j = j0 + u, slot = j < count ? slots[j] : -1;
        ok[u] = slot >= 0;
        const bf16_t* k = kv + (size_t)(ok[u] ? slot : 0) * row_width + (base + j < window ? 0 : entry_col);
        #pragma unroll
        for (int i = 0; i < ATT_PIECES; ++i) {
            const int c = 4 * lane + 128 * i;
            kr[u][i] = ok[u] && c < d ? *reinterpret_cast<const uint2*>(k + c) : make_uint2(0u, 0u);
        }
    }
    float s[ATT_U][ATT_G];
    #pragma unroll
    for (int u = 0; u < ATT_U; ++u)
        #pragma unroll
        for (int g = 0; g < ATT_G; ++g) {
            float dot = 0.f;
            #pragma unroll
            for (int i = 0; i < ATT_PIECES; ++i) {
                float f[4];
                bf16x4_to_f(kr[u][i], f);
                const float4 qv = *reinterpret_cast<const float4*>(&qs[g][4 * lane + 128 * i]);
                dot += qv.x * f[0] + qv.y * f[1] + qv.z * f[2] + qv.w * f[3];
            }
            s[u][g] = warp_sum(dot) * scale;
        }
    #pragma unroll
    for (int g = 0; g < ATT_G; ++g) {
        float mx = m[g];
        #pragma unroll
        for (int u = 0; u < ATT_U; ++u) mx = ok[u] ? fmaxf(mx, s[u][g]) : mx;
        if (mx == -INFINITY) continue;                                    // no key yet (the whole warp)
        const float corr = expf(m[g] - mx);
        l[g] *= corr;
        #pragma unroll
        for (int i = 0; i < ATT_PIECES; ++i)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[g][i][e] *= corr;
        #pragma unroll
        for (int u = 0; u < ATT_U; ++u) {
            if (!ok[u]) continue;
            const float p = expf(s[u][g] - mx);
            l[g] += p;
            #pragma unroll
            for (int i = 0; i < ATT_PIECES; ++i) {
                float f[4];
                bf16x4_to_f(kr[u][i], f);
                #pragma unroll
                for (int e = 0; e < 4; ++e) acc[g][i][e] += p * f[e];
            }
        }
        m[g] = mx;
    }
}

// sparse_decode: grid (T, heads / ATT_G), ATT_THREADS threads. q float32 [T, heads, d] (roped); kv: the layer's
// bf16 rows; tables int32 [T, max_blocks]; positions int32 [T]; ids int32 [T, topk] (read only when topk > 0);
// sinks float32 [heads]; out float32 [T, heads, d].
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2)
sparse_decode(const float* __restrict__ q, const bf16_t* __restrict__ kv, const int* __restrict__ tables,
              const int* __restrict__ positions, const int* __restrict__ ids, const float* __restrict__ sinks,
              float* __restrict__ out, int max_blocks, int block, int row_width, int d, int window, int rate,
              int topk, int entry_col, float scale) {
    pdl_begin();
    __shared__ __align__(16) float qs[ATT_G][ATT_D];
    __shared__ float ob[ATT_G][ATT_D], wmax[ATT_WARPS][ATT_G], wsum[ATT_WARPS][ATT_G];
    __shared__ int slots[ATT_CHUNK];
    const int t = blockIdx.x, h0 = blockIdx.y * ATT_G, heads = gridDim.y * ATT_G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p = positions[t];
    float* o = out + ((size_t)t * heads + h0) * d;                       // the group's heads, one after another
    if (p < 0) {                                                          // the whole CTA
        for (int c = threadIdx.x; c < ATT_G * d; c += ATT_THREADS) o[c] = 0.f;
        return;
    }
    for (int c = threadIdx.x; c < ATT_G * ATT_D; c += ATT_THREADS)
        qs[c / ATT_D][c % ATT_D] = c % ATT_D < d ? q[((size_t)t * heads + h0 + c / ATT_D) * d + c % ATT_D] : 0.f;
    const int* table = tables + (size_t)t * max_blocks;
    const int* row_ids = ids + (size_t)t * topk;
    const int n = window + (rate ? (topk ? topk : (p + 1) / rate) : 0);
    float m[ATT_G], l[ATT_G], acc[ATT_G][ATT_PIECES][4];
    #pragma unroll
    for (int g = 0; g < ATT_G; ++g) {
        m[g] = -INFINITY, l[g] = 0.f;
        #pragma unroll
        for (int i = 0; i < ATT_PIECES; ++i)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[g][i][e] = 0.f;
    }
    for (int base = 0; base < n; base += ATT_CHUNK) {
        const int count = min(ATT_CHUNK, n - base);
        __syncthreads();                                                  // the last chunk's slots are read
        for (int j = threadIdx.x; j < count; j += ATT_THREADS) {
            const int at = key_position(base + j, p, row_ids, window, rate, topk);
            slots[j] = key_slot(at, table, block);
        }
        __syncthreads();
        for (int j0 = warp * ATT_U; j0 < count; j0 += ATT_WARPS * ATT_U)
            att_keys(kv, slots, j0, count, base, window, row_width, entry_col, d, scale, qs, m, l, acc);
    }
    if (lane == 0)
        for (int g = 0; g < ATT_G; ++g) wmax[warp][g] = m[g], wsum[warp][g] = l[g];
    __syncthreads();
    float den[ATT_G], f[ATT_G];                                           // per head: the sink and the warps
    #pragma unroll
    for (int g = 0; g < ATT_G; ++g) {
        float mx = sinks[h0 + g];
        for (int w = 0; w < ATT_WARPS; ++w) mx = fmaxf(mx, wmax[w][g]);
        den[g] = expf(sinks[h0 + g] - mx);
        for (int w = 0; w < ATT_WARPS; ++w) den[g] += wsum[w][g] * expf(wmax[w][g] - mx);
        f[g] = m[g] == -INFINITY ? 0.f : expf(m[g] - mx);
    }
    for (int w = 0; w < ATT_WARPS; ++w) {                                 // the warps' partials in warp order
        if (warp == w)
            #pragma unroll
            for (int g = 0; g < ATT_G; ++g)
                #pragma unroll
                for (int i = 0; i < ATT_PIECES; ++i)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int c = 4 * lane + 128 * i + e;
                        if (c < d) ob[g][c] = (w ? ob[g][c] : 0.f) + acc[g][i][e] * f[g];
                    }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < ATT_G * d; c += ATT_THREADS) o[c] = ob[c / d][c % d] / den[c / d];
}

// write_rows: grid (T), ATT_THREADS threads. rows float32 [T, width] -> kv[slots[t], col:col + width] as bf16.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
write_rows(bf16_t* kv, const int* __restrict__ slots, const float* __restrict__ rows, int width, int row_width,
           int col) {
    pdl_begin();
    const int t = blockIdx.x, slot = slots[t];
    if (slot < 0) return;
    for (int c = threadIdx.x; c < width; c += ATT_THREADS)
        kv[(size_t)slot * row_width + col + c] = f_to_bf16(rows[(size_t)t * width + c]);
}
