// MLA's absorbed-form projections around mla_decode.cu for decode-sized steps (T <= MAX_T tokens), in place
// of two cuBLAS strided-batched GEMMs that cannot start before the kernel ahead of them ends. kv_b is the
// layer's kv_b_proj [H·(N + V), R] bf16: head h's W_UK rows h·(N+V) .. + N, its W_UV rows the V after them.
//   mla_absorb_q: q_lat[t, h, r] = sum_n q[t, h·qk + n] · kv_b[h·(N+V) + n, r]      float32 out [T, H, R]
//   mla_absorb_o: o[t, h·V + v]  = bf16(sum_r o_lat[t, h·R + r] · kv_b[h·(N+V) + N + v, r])   bf16 out
// fp32 accumulation. Each CTA's weights are loaded into registers before the programmatic-launch wait (no
// kernel of the step writes them), so under PDL the weight read overlaps the kernel ahead; only the step's
// q or o_lat rows (a few KB, L2) are read after it.
// mla_absorb_q: grid (ceil(R / 64), H), 256 threads: thread (rg = tid / 8, cg = tid % 8) holds the 8
// columns cg·8 .. of the CTA's 64 for the rows n = rg, rg + 32, ... (N <= 32·MAX_ROWS), then the 32 row
// groups are summed (shuffles within a warp, shared memory across the 8 warps).
// mla_absorb_o: grid (ceil(V / 8), H), 256 threads: warp w owns output row v = 8·blockIdx.x + w, its lanes
// split R in 16-byte pieces (R <= 256·MAX_PIECES).
// Roofline: W_UK and W_UV once each per step, H·(N + V)·R·2 bytes (V2-Lite: 2 MB each, ~0.5 µs at 4.3 TB/s);
// at decode both are latency-bound: one weight round trip (hidden under PDL) and one of the step's rows.
#include "mla_latent.cuh"      // mla_absorb_q_cache's prologue part (and common.cuh)

#define MAX_T 8                 // tokens per launch (gpu_mla_ops.MLA_ABSORB_MAX_TOKENS)
#define MAX_ROWS 8              // mla_absorb_q: nope rows per thread (N <= 256)
#define MAX_PIECES 4            // mla_absorb_o: 16-byte pieces of R per lane (R <= 1024)
#define QCOLS 64                // mla_absorb_q: latent columns per CTA

__device__ __forceinline__ void fma8(float (&acc)[8], float x, uint4 w) {
    const bf16_t* ws = reinterpret_cast<const bf16_t*>(&w);
    #pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += x * bf16_to_f(ws[e]);
}

// The q_lat columns of CTA (blockIdx.x, head blockIdx.y); q rows q_stride values apart.
__device__ __forceinline__ void absorb_q(const bf16_t* __restrict__ q, int q_stride, const bf16_t* __restrict__ kv_b,
                                         float* __restrict__ q_lat, int T, int H, int N, int V, int R, int qk) {
    __shared__ float red[8][MAX_T][QCOLS];
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rg = threadIdx.x >> 3, cg = threadIdx.x & 7;
    const int c0 = blockIdx.x * QCOLS + cg * 8;
    const bool col_ok = c0 < R;                             // R % 8 == 0: a piece is all in or all out
    const bf16_t* w = kv_b + (size_t)h * (N + V) * R + c0;
    uint4 wv[MAX_ROWS];
    #pragma unroll
    for (int i = 0; i < MAX_ROWS; ++i) {
        const int n = rg + 32 * i;
        wv[i] = col_ok && n < N ? __ldg(reinterpret_cast<const uint4*>(w + (size_t)n * R)) : kZero16;
    }
    pdl_wait();
    pdl_launch_dependents();
    float acc[MAX_T][8];
    #pragma unroll
    for (int t = 0; t < MAX_T; ++t) {
        #pragma unroll
        for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
        if (t < T) {
            const bf16_t* qt = q + (size_t)t * q_stride + (size_t)h * qk;
            #pragma unroll
            for (int i = 0; i < MAX_ROWS; ++i) {
                const int n = rg + 32 * i;
                if (n < N) fma8(acc[t], bf16_to_f(qt[n]), wv[i]);
            }
        }
    }
    // The warp's 4 row groups (lanes cg, cg + 8, cg + 16, cg + 24), then the 8 warps.
    #pragma unroll
    for (int t = 0; t < MAX_T; ++t) {
        if (t < T) {
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                float v = acc[t][e];
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                if (lane < 8) red[warp][t][cg * 8 + e] = v;
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < T * QCOLS; i += blockDim.x) {
        const int t = i / QCOLS, c = i % QCOLS, col = blockIdx.x * QCOLS + c;
        if (col >= R) continue;
        float s = 0.f;
        #pragma unroll
        for (int k = 0; k < 8; ++k) s += red[k][t][c];
        q_lat[((size_t)t * H + h) * R + col] = s;
    }
}

extern "C" __global__ void __launch_bounds__(256)
mla_absorb_q(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv_b, float* __restrict__ q_lat, int T,
             int H, int N, int V, int R, int qk) {
    absorb_q(q, H * qk, kv_b, q_lat, T, H, N, V, R, qk);
}

// mla_absorb_q reading q_nope straight from the fused down-projection rows y [T, q_cols + R + Dr]
// (q_lora_rank unset: q_cols = H·qk), and mla_latent_cache.cu's work done by one more column of CTAs
// (blockIdx.x = ceil(R / 64): tokens blockIdx.y, blockIdx.y + H, ...): the latent and rope key to the
// paged cache (bf16, or e4m3 of value / scale: mla_absorb_q_cache_fp8), the query columns to q_out
// (mla_decode.cu's rope part). One launch for the two.
template <bool FP8>
__device__ __forceinline__ void absorb_q_cache(const bf16_t* __restrict__ y, const bf16_t* __restrict__ kv_b,
                                               float* __restrict__ q_lat, int T, int H, int N, int V, int R, int qk,
                                               int Dr, const bf16_t* __restrict__ kv_norm, float eps,
                                               const float* __restrict__ inv_freq, float attn_factor,
                                               const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                               void* __restrict__ cache, bf16_t* __restrict__ q_out, float scale) {
    const int q_cols = H * qk, width = q_cols + R + Dr;
    if (blockIdx.x < gridDim.x - 1) {
        absorb_q(y, width, kv_b, q_lat, T, H, N, V, R, qk);
        return;
    }
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float scratch[33];
    for (int t = blockIdx.y; t < T; t += gridDim.y)
        mla_latent_row<FP8>(y + (size_t)t * width, q_cols, R, Dr, kv_norm, nullptr, eps, inv_freq, attn_factor,
                            (float)positions[t], slot_mapping[t], cache, scale, q_out + (size_t)t * q_cols, scratch);
}

extern "C" __global__ void __launch_bounds__(256)
mla_absorb_q_cache(const bf16_t* __restrict__ y, const bf16_t* __restrict__ kv_b, float* __restrict__ q_lat,
                   int T, int H, int N, int V, int R, int qk, int Dr, const bf16_t* __restrict__ kv_norm, float eps,
                   const float* __restrict__ inv_freq, float attn_factor, const int* __restrict__ positions,
                   const int* __restrict__ slot_mapping, bf16_t* __restrict__ cache, bf16_t* __restrict__ q_out) {
    absorb_q_cache<false>(y, kv_b, q_lat, T, H, N, V, R, qk, Dr, kv_norm, eps, inv_freq, attn_factor, positions,
                          slot_mapping, cache, q_out, 1.f);
}

extern "C" __global__ void __launch_bounds__(256)
mla_absorb_q_cache_fp8(const bf16_t* __restrict__ y, const bf16_t* __restrict__ kv_b, float* __restrict__ q_lat,
                       int T, int H, int N, int V, int R, int qk, int Dr, const bf16_t* __restrict__ kv_norm,
                       float eps, const float* __restrict__ inv_freq, float attn_factor,
                       const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                       unsigned char* __restrict__ cache, bf16_t* __restrict__ q_out, float scale) {
    absorb_q_cache<true>(y, kv_b, q_lat, T, H, N, V, R, qk, Dr, kv_norm, eps, inv_freq, attn_factor, positions,
                         slot_mapping, cache, q_out, scale);
}

extern "C" __global__ void __launch_bounds__(256)
mla_absorb_o(const bf16_t* __restrict__ o_lat, const bf16_t* __restrict__ kv_b, bf16_t* __restrict__ o, int T,
             int H, int N, int V, int R) {
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int v = blockIdx.x * 8 + warp;
    const bool row_ok = v < V;                              // warp-uniform
    const bf16_t* w = kv_b + ((size_t)h * (N + V) + N + (row_ok ? v : 0)) * R;
    uint4 wv[MAX_PIECES];
    #pragma unroll
    for (int p = 0; p < MAX_PIECES; ++p) {
        const int r = (lane + 32 * p) * 8;
        wv[p] = row_ok && r < R ? __ldg(reinterpret_cast<const uint4*>(w + r)) : kZero16;
    }
    pdl_wait();
    pdl_launch_dependents();
    if (!row_ok) return;
    for (int t = 0; t < T; ++t) {
        const bf16_t* x = o_lat + ((size_t)t * H + h) * R;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int p = 0; p < MAX_PIECES; ++p) {
            const int r = (lane + 32 * p) * 8;
            if (r < R) {
                const uint4 xv = *reinterpret_cast<const uint4*>(x + r);
                const bf16_t* xs = reinterpret_cast<const bf16_t*>(&xv);
                const bf16_t* ws = reinterpret_cast<const bf16_t*>(&wv[p]);
                #pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] += bf16_to_f(xs[e]) * bf16_to_f(ws[e]);
            }
        }
        float s = 0.f;
        #pragma unroll
        for (int e = 0; e < 8; ++e) s += acc[e];
        s = warp_sum(s);
        if (lane == 0) o[(size_t)t * H * V + (size_t)h * V + v] = f_to_bf16(s);
    }
}
