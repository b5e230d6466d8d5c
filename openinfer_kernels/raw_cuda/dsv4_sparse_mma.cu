// DeepSeek-V4's attention of many rows at once (a prompt's prefill) on tensor cores: sparse_decode's definition
// (dsv4_attention.cu: each row's sliding window and compressed entries, dsv4_keys.cuh, one shared K = V head of
// SM_D values, the per-head sink in the softmax's denominator), for the CTA's 16·SM_MW query heads of one row:
//   S = Q Kᵀ (heads x keys),  P = softmax(scale · S) with the sink,  O = P V.
// The row's heads are the M dimension of mma.m16n8k16 (bf16 operands, float32 accumulation), so each key row is
// staged once for all of them (sparse_decode reads it once per head group, on CUDA cores). q is rounded to bf16
// and P to bf16 for P·V, as FlashAttention and a bf16 model's eager attention take them.
//   * Q (bf16) stays in shared memory; keys go through shared memory in tiles of SM_BN rows (cp.async, SM_STAGES
//     stages), their slots resolved SM_CHUNK at a time (the ids -> block table -> slot chain).
//   * Warp (w, s) of SM_WARPS = SM_MW x SM_SPLIT takes head tile w and the s-th SM_D / SM_SPLIT columns: it holds
//     that part of O (SM_NT n8 tiles) and computes the partial S over its columns; the SM_SPLIT partials go
//     through shared memory and each warp of the tile sums them in the same order, so all hold the same S and P.
//   * The online softmax runs in the log2 domain on the S fragments (rows g and g + 8 of the tile a lane's).
// q float32 [T, heads, SM_D] (roped), out float32 [T, heads, SM_D]; grid (T, ceil(heads / (16·SM_MW))),
// SM_THREADS threads, sparse_smem_bytes() of dynamic shared memory (gpu_dsv4_ops.py). SM_D % 32 == 0.
// Roofline (V4-Flash, 64 heads, d 512, a CSA layer's 128 + 512 keys): 4·64·640·512 = 84 MFLOP and 655 KB of
// key rows (L2 mostly: neighbouring rows share their window) a row; 8,192 rows 687 GFLOP, ~1.1 ms at
// 600 TFLOP/s of mma.sync (sparse_decode on CUDA cores: ~28 ms a layer at that size, H100 2026-12-07).
#include "common.cuh"
#include "mma.cuh"
#include "dsv4_keys.cuh"

#ifndef SM_D
#define SM_D 512                           // head dim
#endif
#ifndef SM_MW
#define SM_MW 4                            // 16-head tiles a CTA
#endif
#define SM_SPLIT 2                         // warps over a head tile's columns
#define SM_WARPS (SM_MW * SM_SPLIT)
#define SM_THREADS (32 * SM_WARPS)
#define SM_HEADS (16 * SM_MW)
#define SM_BN 16                           // keys a tile: one k step of P·V
#define SM_STAGES 3
#define SM_LDS (SM_D + 8)                  // bf16 pitch of the Q and key rows: fragment reads bank-conflict free
#define SM_DW (SM_D / SM_SPLIT)            // columns a warp
#define SM_NT (SM_DW / 8)                  // its O n8 tiles
#define SM_KT (SM_DW / 16)                 // its k steps of the partial S
#define SM_CHUNK 1024                      // keys whose slots a CTA resolves at a time
#define SM_LOG2E 1.4426950408889634f
static_assert(SM_D % 32 == 0, "SM_D must be a multiple of 32");

struct SparseSmem {
    bf16_t q[SM_HEADS * SM_LDS];
    bf16_t k[SM_STAGES][SM_BN * SM_LDS];
    float s[SM_WARPS][2 * 4 * 32];         // each warp's partial S fragments, slot-major
    int slots[SM_CHUNK];
};

// The online softmax state of a lane's two head rows (g, g + 8): running max (log2 units), sum, and O's part.
struct RowsState {
    float m[2], l[2];
    float o[SM_NT][4];
};

// Q of the CTA's heads as bf16 (heads past `heads` zero).
__device__ __forceinline__ void stage_q(SparseSmem& sm, const float* __restrict__ q, int t, int h0, int heads) {
    for (int i = threadIdx.x; i < SM_HEADS * (SM_D / 4); i += SM_THREADS) {
        const int r = i / (SM_D / 4), c = 4 * (i % (SM_D / 4)), h = h0 + r;
        const float4 v = h < heads ? *reinterpret_cast<const float4*>(q + ((size_t)t * heads + h) * SM_D + c)
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<unsigned*>(sm.q + r * SM_LDS + c) = pack_bf16(v.x, v.y);
        *reinterpret_cast<unsigned*>(sm.q + r * SM_LDS + c + 2) = pack_bf16(v.z, v.w);
    }
}

// The full S of the warp's head tile for key tile `k` (16 keys: two n8 tiles), summed over the column splits.
__device__ __forceinline__ void tile_scores(SparseSmem& sm, const bf16_t* k, int mw, int ds, float (&s)[2][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const bf16_t* q0 = sm.q + (16 * mw + g) * SM_LDS + ds * SM_DW + 2 * tq;
    float part[2][4] = {};
    #pragma unroll
    for (int kk = 0; kk < SM_KT; ++kk) {
        const bf16_t* qa = q0 + 16 * kk;
        const unsigned a0 = *reinterpret_cast<const unsigned*>(qa), a1 = *reinterpret_cast<const unsigned*>(qa + 8 * SM_LDS);
        const unsigned a2 = *reinterpret_cast<const unsigned*>(qa + 8), a3 = *reinterpret_cast<const unsigned*>(qa + 8 * SM_LDS + 8);
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bf16_t* kp = k + (8 * j + g) * SM_LDS + ds * SM_DW + 16 * kk + 2 * tq;
            mma_16816(part[j], a0, a1, a2, a3, *reinterpret_cast<const unsigned*>(kp),
                      *reinterpret_cast<const unsigned*>(kp + 8));
        }
    }
    #pragma unroll
    for (int j = 0; j < 2; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) sm.s[warp][(4 * j + e) * 32 + lane] = part[j][e];
    __syncthreads();
    #pragma unroll
    for (int j = 0; j < 2; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            float v = 0.f;
            #pragma unroll
            for (int w = 0; w < SM_SPLIT; ++w) v += sm.s[mw * SM_SPLIT + w][(4 * j + e) * 32 + lane];
            s[j][e] = v;
        }
}

// Fold key tile `k` (keys j0 .. j0 + 15 of the chunk; masked where their slot is -1 or past `count`) into the
// lane's rows: the softmax update, then O += P V (V = the key rows, fragments by ldmatrix.trans).
__device__ __forceinline__ void fold_tile(SparseSmem& sm, const bf16_t* k, int j0, int count, float scale_log2,
                                          int mw, int ds, RowsState& st) {
    const int lane = threadIdx.x & 31, tq = lane & 3;
    float s[2][4];
    tile_scores(sm, k, mw, ds, s);
    float mx[2] = {-INFINITY, -INFINITY};
    #pragma unroll
    for (int j = 0; j < 2; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = j0 + 8 * j + 2 * tq + (e & 1);
            s[j][e] = key < count && sm.slots[key] >= 0 ? s[j][e] * scale_log2 : -INFINITY;
            mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
        }
    float base[2], alpha[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(st.m[r], mx[r]);
        base[r] = m_new == -INFINITY ? 0.f : m_new;
        alpha[r] = exp2f(st.m[r] - base[r]);
        st.m[r] = m_new;
    }
    unsigned pa[4];
    float sum[2] = {0.f, 0.f};
    #pragma unroll
    for (int j = 0; j < 2; ++j)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float p0 = round_bf16(exp2f(s[j][2 * r] - base[r])), p1 = round_bf16(exp2f(s[j][2 * r + 1] - base[r]));
            sum[r] += p0 + p1;
            pa[2 * j + r] = pack_bf16(p0, p1);              // a0: rows g keys 0-7, a1: g + 8, a2 / a3: keys 8-15
        }
    #pragma unroll
    for (int r = 0; r < 2; ++r) st.l[r] = st.l[r] * alpha[r] + sum[r];
    #pragma unroll
    for (int i = 0; i < SM_NT; ++i) {
        st.o[i][0] *= alpha[0]; st.o[i][1] *= alpha[0];
        st.o[i][2] *= alpha[1]; st.o[i][3] *= alpha[1];
    }
    const bf16_t* vp = k + ((lane & 7) + ((lane >> 3) & 1) * 8) * SM_LDS + ds * SM_DW + (lane >> 4) * 8;
    #pragma unroll
    for (int i = 0; i < SM_NT; i += 2) {
        unsigned b[4];
        ldmatrix_x4_trans(b, vp + 8 * i);
        mma_16816(st.o[i], pa[0], pa[1], pa[2], pa[3], b[0], b[1]);
        mma_16816(st.o[i + 1], pa[0], pa[1], pa[2], pa[3], b[2], b[3]);
    }
}

// Key rows [tile·SM_BN, +SM_BN) of the chunk into stage `st` (zeros for slots -1 and past count; the window's keys
// from column 0, the entries' from entry_col), one cp.async group.
__device__ __forceinline__ void load_keys(SparseSmem& sm, int st, int tile, int count, int base, int window,
                                          const bf16_t* __restrict__ kv, int row_width, int entry_col) {
    for (int i = threadIdx.x; i < SM_BN * (SM_D / 8); i += SM_THREADS) {
        const int r = i / (SM_D / 8), c = i % (SM_D / 8), j = tile * SM_BN + r;
        const int slot = j < count ? sm.slots[j] : -1;
        const bf16_t* src = kv + (size_t)(slot < 0 ? 0 : slot) * row_width + (base + j < window ? 0 : entry_col) + 8 * c;
        cp_async16(sm.k[st] + r * SM_LDS + 8 * c, src, slot >= 0);
    }
    cp_async_commit();
}

// out of the lane's rows: O over the softmax's denominator with the head's sink (natural units, hence · log2 e).
__device__ __forceinline__ void store_rows(const RowsState& st, float* __restrict__ out, const float* __restrict__ sinks,
                                           int t, int h0, int heads, int mw, int ds) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = st.l[r];                                               // the lane's keys' share: the quad's sum
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int h = h0 + 16 * mw + g + 8 * r;
        if (h >= heads) continue;
        const float sink = sinks[h] * SM_LOG2E, mx = fmaxf(st.m[r], sink);
        const float f = st.m[r] == -INFINITY ? 0.f : exp2f(st.m[r] - mx);
        const float inv = 1.f / (l * f + exp2f(sink - mx));
        float* o = out + ((size_t)t * heads + h) * SM_D + ds * SM_DW + 2 * tq;
        #pragma unroll
        for (int i = 0; i < SM_NT; ++i)
            *reinterpret_cast<float2*>(o + 8 * i) = make_float2(st.o[i][2 * r] * f * inv, st.o[i][2 * r + 1] * f * inv);
    }
}

// sparse_prefill: sparse_decode's arguments (q, kv, tables, positions, ids, sinks, out, max_blocks, block,
// row_width, heads, window, rate, topk, entry_col, scale; d = SM_D), grid (T, ceil(heads / SM_HEADS)).
extern "C" __global__ void __launch_bounds__(SM_THREADS)
sparse_prefill(const float* __restrict__ q, const bf16_t* __restrict__ kv, const int* __restrict__ tables,
               const int* __restrict__ positions, const int* __restrict__ ids, const float* __restrict__ sinks,
               float* __restrict__ out, int max_blocks, int block, int row_width, int heads, int window, int rate,
               int topk, int entry_col, float scale) {
    pdl_begin();
    extern __shared__ __align__(16) char smem_raw[];
    SparseSmem& sm = *reinterpret_cast<SparseSmem*>(smem_raw);
    const int t = blockIdx.x, h0 = blockIdx.y * SM_HEADS, warp = threadIdx.x >> 5;
    const int mw = warp / SM_SPLIT, ds = warp % SM_SPLIT;
    const int p = positions[t];
    if (p < 0) {                                                          // a padding row: zeros, the whole CTA
        for (int i = threadIdx.x; i < SM_HEADS * SM_D; i += SM_THREADS)
            if (h0 + i / SM_D < heads) out[((size_t)t * heads + h0) * SM_D + i] = 0.f;
        return;
    }
    stage_q(sm, q, t, h0, heads);
    const int* table = tables + (size_t)t * max_blocks;
    const int* row_ids = ids + (size_t)t * topk;
    const int n = window + (rate ? (topk ? topk : (p + 1) / rate) : 0);
    RowsState st;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.f;
    #pragma unroll
    for (int i = 0; i < SM_NT; ++i) st.o[i][0] = st.o[i][1] = st.o[i][2] = st.o[i][3] = 0.f;
    for (int base = 0; base < n; base += SM_CHUNK) {
        const int count = min(SM_CHUNK, n - base), tiles = (count + SM_BN - 1) / SM_BN;
        __syncthreads();                                                  // the last chunk's slots are read
        for (int j = threadIdx.x; j < count; j += SM_THREADS)
            sm.slots[j] = key_slot(key_position(base + j, p, row_ids, window, rate, topk), table, block);
        __syncthreads();
        #pragma unroll
        for (int s = 0; s < SM_STAGES - 1; ++s) {
            if (s < tiles) load_keys(sm, s, s, count, base, window, kv, row_width, entry_col);
            else cp_async_commit();
        }
        for (int it = 0; it < tiles; ++it) {
            const int next = it + SM_STAGES - 1;                          // its stage was freed by the last sync
            if (next < tiles) load_keys(sm, next % SM_STAGES, next, count, base, window, kv, row_width, entry_col);
            else cp_async_commit();
            cp_async_wait<SM_STAGES - 1>();
            __syncthreads();                                              // tile it is in its stage for everyone
            fold_tile(sm, sm.k[it % SM_STAGES], it * SM_BN, count, scale * SM_LOG2E, mw, ds, st);
            __syncthreads();                                              // its stage and the S partials are free
        }
    }
    store_rows(st, out, sinks, t, h0, heads, mw, ds);
}
