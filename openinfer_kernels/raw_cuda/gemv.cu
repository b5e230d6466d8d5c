// Skinny GEMM for decode: y[M, N] = x[M, K] · w[N, K]ᵀ, bf16 in, fp32 accumulate, bf16 or fp32 out,
// for M <= 8·NT (NT n8 tiles, 1..4), with the decoder's neighbours fused in where they are free:
//   prologue  PRO_RMSNORM  x := bf16(norm_w · bf16(x · rsqrt(mean(x²) + eps)))   (the layer's RMSNorm)
//   epilogue  EPI_RESIDUAL y := bf16(bf16(x·wᵀ) + res_in)   (the residual add; res_in may be y)
//   epilogue  EPI_SILU     y[M, N/2] := silu_mul of the gate and up halves   (the MLP activation)
// each rounding as the separate kernels (rms_norm.cu, silu_mul.cu) and the bf16 reference do. EPI_SILU
// wants the gate_up weight with gate and up rows interleaved in blocks of 8 (gpu_gemm.interleave_gate_up):
// a CTA's 16 rows are then 8 gate rows and their 8 up rows, whose sums meet in one lane's accumulators.
// A prologue is paid per warp and k step, not per element (each x piece is transformed by the 8 lanes
// that share its k slots, whichever weight rows they hold): cheap for the RMSNorm, but a SiLU·up
// prologue in the down GEMV (expf and a division per element) measured 92 µs for the Qwen3-4B down_proj
// against 18 µs plain on the H200 (2026-12-01); in the gate_up epilogue it is paid once per output.
// One CTA per 16 weight rows, 8 warps splitting K; each lane reads 16 bytes of two weight rows (g and
// g+8, g = lane/4) and of one x row per n8 tile per 32-wide k step, and the products run on the tensor
// cores (mma.m16n8k16, bf16): a dot product does not care in which order k is summed, so each lane's
// 8 consecutive k are mapped onto the fragment slots it owns (A and B alike), which keeps every load
// 16-byte and coalesced. The weight loads of the next GEMV_U k steps are issued before the current
// ones are used (register double buffer), and the first ones before pdl_wait: under programmatic
// dependent launch (launch.py) the weight stream starts while the previous kernel is still finishing.
// The RMSNorm prologue has every CTA sum x² of its rows itself (M·K·2 bytes from L2: 5 KB at M = 1,
// H = 2560), which is cheaper than a kernel boundary. The warps' partial tiles are summed in shared
// memory. K and the weight's row stride must be multiples of 8 and the rows 16-byte aligned.
// Roofline: N·K·2 weight bytes (+ M·K·2 of x, M·N of y): Qwen3-4B gate_up (19456 x 2560) is 99.6 MB,
// 23 µs at 4.3 TB/s; at M <= 32 the tensor cores have > 20x headroom, so it is purely bandwidth-bound.
#include "common.cuh"
#include "mma.cuh"
#include "gemv_cta.cuh"

#define GEMV_WARPS 8
#ifndef GEMV_U
#define GEMV_U 2                          // k steps per weight batch (x2 in flight: double buffer)
#endif
#define PRO_NONE 0
#define PRO_RMSNORM 1

__device__ __forceinline__ const bf16_t* zero16() { return reinterpret_cast<const bf16_t*>(&kZero16); }

__device__ __forceinline__ uint4 load_streaming(const bf16_t* p) {   // weights: read once, evict first
    return __ldcs(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 load_cached(const bf16_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }


template <int NT, int PRO, int EPI, typename OutT>
__device__ __forceinline__ void gemv_tile(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, OutT* y,
                                          int M, int N, int K, const bf16_t* __restrict__ norm_w,
                                          const bf16_t* res_in, float eps, int ldw) {
    constexpr int U = NT <= 2 ? GEMV_U : (GEMV_U > 2 ? GEMV_U / 2 : 1);
    __shared__ GemvPartials<NT, 1, GEMV_WARPS> red;
    __shared__ float rstd_s[NT * 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int row0 = blockIdx.x * 16;
    const bool lo_ok = row0 + g < N, hi_ok = row0 + g + 8 < N;
    const bf16_t* w_lo = w + (size_t)(lo_ok ? row0 + g : 0) * ldw;
    const bf16_t* w_hi = w + (size_t)(hi_ok ? row0 + g + 8 : 0) * ldw;
    const bf16_t* x_row[NT];
    bool x_ok[NT];
    gemv_x_rows(x, M, K, g, x_row, x_ok);
    const int steps = (K + 31) / 32;
    const int per_warp = (steps + GEMV_WARPS - 1) / GEMV_WARPS;
    const int s_begin = warp * per_warp, s_end = min(steps, s_begin + per_warp);

    // Weights of k steps s0 .. s0+U-1; out-of-range pieces read a zero vector (the select is on the
    // address, never on loaded data, so nothing waits on a load before all loads are issued).
    uint4 a_lo[U], a_hi[U];
    auto load_weights = [&](uint4 (&lo)[U], uint4 (&hi)[U], int s0) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = (s0 + u) * 32 + tq * 8;
            const bool k_ok = s0 + u < s_end && k < K;
            lo[u] = load_streaming(k_ok && lo_ok ? w_lo + k : zero16());
            hi[u] = load_streaming(k_ok && hi_ok ? w_hi + k : zero16());
        }
    };
    load_weights(a_lo, a_hi, s_begin);
    pdl_wait();                      // from here on: x, norm_w, res_in and y are the previous kernels'
    pdl_launch_dependents();

    float rs[NT];
    if (PRO == PRO_RMSNORM) {
        __shared__ float part[GEMV_WARPS][NT * 8];
        float ss[NT * 8];
        #pragma unroll
        for (int m = 0; m < NT * 8; ++m) ss[m] = 0.f;
        for (int i = threadIdx.x; i < K / 8; i += blockDim.x)
            #pragma unroll
            for (int m = 0; m < NT * 8; ++m) {
                if (m < M) {
                    uint4 v = load_cached(x + (size_t)m * K + i * 8);
                    const bf16_t* vs = reinterpret_cast<const bf16_t*>(&v);
                    #pragma unroll
                    for (int e = 0; e < 8; ++e) { const float f = bf16_to_f(vs[e]); ss[m] += f * f; }
                }
            }
        #pragma unroll
        for (int m = 0; m < NT * 8; ++m) {
            const float s = warp_sum(ss[m]);
            if (lane == 0) part[warp][m] = s;
        }
        __syncthreads();
        if (threadIdx.x < NT * 8) {
            float s = 0.f;
            #pragma unroll
            for (int wp = 0; wp < GEMV_WARPS; ++wp) s += part[wp][threadIdx.x];
            rstd_s[threadIdx.x] = rsqrtf(s / K + eps);
        }
        __syncthreads();
        #pragma unroll
        for (int n = 0; n < NT; ++n) rs[n] = rstd_s[n * 8 + g];
    }

    float c[NT][4];
    #pragma unroll
    for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
    for (int s0 = s_begin; s0 < s_end; s0 += U) {
        uint4 b[U][NT], nw[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = (s0 + u) * 32 + tq * 8;
            const bool k_ok = s0 + u < s_end && k < K;
            #pragma unroll
            for (int n = 0; n < NT; ++n) {
                b[u][n] = load_cached(k_ok && x_ok[n] ? x_row[n] + k : zero16());
            }
            if (PRO == PRO_RMSNORM) nw[u] = load_cached(k_ok ? norm_w + k : zero16());
        }
        uint4 an_lo[U], an_hi[U];
        load_weights(an_lo, an_hi, s0 + U);          // next batch in flight while this one is used
        #pragma unroll
        for (int u = 0; u < U; ++u)
            #pragma unroll
            for (int n = 0; n < NT; ++n) {
                if (PRO == PRO_RMSNORM) b[u][n] = rmsnorm8(b[u][n], nw[u], rs[n]);
                // k slots (2tq, 2tq+1 | 2tq+8, 2tq+9) of the first mma <- this lane's k 0..3, the second <- 4..7
                mma_16816(c[n], a_lo[u].x, a_hi[u].x, a_lo[u].y, a_hi[u].y, b[u][n].x, b[u][n].y);
                mma_16816(c[n], a_lo[u].z, a_hi[u].z, a_lo[u].w, a_hi[u].w, b[u][n].z, b[u][n].w);
            }
        #pragma unroll
        for (int u = 0; u < U; ++u) { a_lo[u] = an_lo[u]; a_hi[u] = an_hi[u]; }
    }
    gemv_store<NT, EPI>(c, red, 0, warp, y, M, N, row0, res_in);
}

// Every entry: (x, w, y, M, N, K, norm_w, res_in, eps, ldw); the pointers a variant does not use may be 0;
// ldw: w's row stride in values (K for a plain weight; more where w is a view of wider rows).
#define GEMV_VARIANT(NAME, NT, PRO, RES, OUT)                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                        \
    gemv_##NAME##_n##NT(const bf16_t* x, const bf16_t* w, OUT* y, int M, int N, int K,                  \
                        const bf16_t* norm_w, const bf16_t* res_in, float eps, int ldw) {                \
        gemv_tile<NT, PRO, RES>(x, w, y, M, N, K, norm_w, res_in, eps, ldw);                             \
    }
#define GEMV_ENTRY(NT)                                                                                   \
    GEMV_VARIANT(bf16, NT, PRO_NONE, EPI_NONE, bf16_t)                                                   \
    GEMV_VARIANT(f32, NT, PRO_NONE, EPI_NONE, float)                                                     \
    GEMV_VARIANT(norm, NT, PRO_RMSNORM, EPI_NONE, bf16_t)                                                \
    GEMV_VARIANT(res, NT, PRO_NONE, EPI_RESIDUAL, bf16_t)                                                \
    GEMV_VARIANT(norm_silu, NT, PRO_RMSNORM, EPI_SILU, bf16_t)                                          \
    GEMV_VARIANT(silu, NT, PRO_NONE, EPI_SILU, bf16_t)

GEMV_ENTRY(1)
GEMV_ENTRY(2)
GEMV_ENTRY(3)
GEMV_ENTRY(4)
