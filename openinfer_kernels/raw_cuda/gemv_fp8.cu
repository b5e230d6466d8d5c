// W8A8 decode GEMV: FP8 e4m3 weights and activations, float32 scales, for M <= 16 rows (NT n8 tiles, 1..2):
//   y[m, n] = sum_kb sw(n, kb) · sx[kb·ldx + m] · (xq[m, 128kb : 128kb + 128] · wq[n, 128kb : 128kb + 128])
// xq / sx from fp8_quant.cu (per token and 128-group, MN-major scales), wq [N, K] as the checkpoint holds it
// (no re-pack), sw: FP8_CHANNEL 0 block scales ws[n / 128][kb] ([ceil(N/128)][K/128], weight_scale_inv of
// quant_method fp8 with weight_block_size [128, 128]); 1 one scale a row, ws[n] (compressed-tensors
// float-quantized channel / tensor strategies), applied after the sum. Activations are e4m3 as in DeepGEMM
// and vLLM: the product runs on FP8 tensor cores (mma.m16n8k32.e4m3, products exact), nothing is dequantized,
// and decode rows round like the prefill GEMM's. The inner sum of each 128-block starts from zero and is
// promoted into the float32 total with its scales (FP8 tensor-core accumulation keeps fewer bits: DeepGEMM's
// reason for promoting per block). K % 128 == 0; rows 16-byte aligned.
// A lane loads 16 bytes of weight rows g and g + 8 per 64-wide k step (two mmas), as gemv.cu's lanes do;
// CTA: FP8_RT tiles of 16 rows, the 8 warps split the 128-blocks FP8_KW ways per tile (gemv_cta.cuh).
// The blocks of the next FP8_U are in flight while the current ones are used, the first before pdl_wait.
// Roofline: N·K weight bytes + N·K/128²·4 (block) or N·4 scale bytes + M·K (x) + M·N·2 (y): Qwen3-8B qkv
// (6144 x 4096) 25.2 MB, 5.2 µs at 4.8 TB/s, half of gemv.cu's bf16 bytes; down (4096 x 12288) 50.3 MB, 10.5 µs.
#include "common.cuh"
#include "mma.cuh"
#include "gemv_cta.cuh"

#ifndef FP8_CHANNEL
#define FP8_CHANNEL 0
#endif
#ifndef FP8_RT
#define FP8_RT 2                          // 16-row tiles per CTA
#endif
#ifndef FP8_U
#define FP8_U 2                           // 128-blocks per weight batch (x2 in flight)
#endif
#define FP8_WARPS 8
#define FP8_KW (FP8_WARPS / FP8_RT)

// One warp's share of one tile: c += the sum over its 128-blocks of the promoted block products (before the
// per-channel scale). Weight piece of block b, half h: rows row0 + g (+ 8), k = 128b + 64h + 16·tq.
template <int NT>
__device__ __forceinline__ void fp8_tile_dots(const unsigned char* __restrict__ xq, const float* __restrict__ sx, int ldx,
                                              const unsigned char* __restrict__ wq, const float* __restrict__ ws,
                                              int M, int N, int K, int tile, int kw, bool wait_first, float (&c)[NT][4]) {
    constexpr int U = FP8_U;
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int KB = K / 128, per_warp = (KB + FP8_KW - 1) / FP8_KW;
    const int b_begin = kw * per_warp, b_end = min(KB, b_begin + per_warp);
    const int row0 = tile * 16;
    const unsigned char* w_lo = wq + (size_t)min(row0 + g, N - 1) * K + tq * 16;
    const unsigned char* w_hi = wq + (size_t)min(row0 + g + 8, N - 1) * K + tq * 16;
    const float* sw = ws + (size_t)(row0 / 128) * KB;                     // the tile's block row (block scales)
    const unsigned char* x_row[NT];
    bool x_ok[NT];
    gemv_x_rows(xq + tq * 16, M, K, g, x_row, x_ok);

    uint4 lo[U][2], hi[U][2];
    auto load_weights = [&](uint4 (&l)[U][2], uint4 (&h)[U][2], int b0) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t k = (size_t)min(b0 + u, b_end - 1) * 128;          // past the end: a repeat, never used
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                l[u][half] = __ldcs(reinterpret_cast<const uint4*>(w_lo + k + 64 * half));
                h[u][half] = __ldcs(reinterpret_cast<const uint4*>(w_hi + k + 64 * half));
            }
        }
    };
    if (b_begin < b_end) load_weights(lo, hi, b_begin);
    if (wait_first) {
        pdl_wait();                  // from here on: xq, sx, res_in and y are the previous kernels'
        pdl_launch_dependents();
    }
    for (int b0 = b_begin; b0 < b_end; b0 += U) {
        uint4 xb[U][NT][2];
        float sxm[U][NT][2];                                               // tokens 8n + 2tq + (0, 1)
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = min(b0 + u, b_end - 1);
            #pragma unroll
            for (int n = 0; n < NT; ++n) {
                #pragma unroll
                for (int half = 0; half < 2; ++half)
                    xb[u][n][half] = __ldg(reinterpret_cast<const uint4*>(
                        x_ok[n] ? x_row[n] + (size_t)b * 128 + 64 * half : reinterpret_cast<const unsigned char*>(&kZero16)));
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int m = n * 8 + 2 * tq + e;
                    sxm[u][n][e] = m < M ? __ldg(sx + (size_t)b * ldx + m) : 0.f;
                }
            }
        }
        uint4 nlo[U][2], nhi[U][2];
        if (b0 + U < b_end) load_weights(nlo, nhi, b0 + U);              // next batch in flight
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (b0 + u >= b_end) break;
            const float swb = FP8_CHANNEL ? 1.f : __ldg(sw + b0 + u);
            #pragma unroll
            for (int n = 0; n < NT; ++n) {
                float cb[4] = {0.f, 0.f, 0.f, 0.f};
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const uint4 l = lo[u][half], h = hi[u][half], xv = xb[u][n][half];
                    mma_16832_e4m3(cb, l.x, h.x, l.y, h.y, xv.x, xv.y);
                    mma_16832_e4m3(cb, l.z, h.z, l.w, h.w, xv.z, xv.w);
                }
                #pragma unroll
                for (int j = 0; j < 4; ++j) c[n][j] += cb[j] * (swb * sxm[u][n][j & 1]);
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u)
            #pragma unroll
            for (int half = 0; half < 2; ++half) { lo[u][half] = nlo[u][half]; hi[u][half] = nhi[u][half]; }
    }
    if (FP8_CHANNEL) {
        const float s_lo = __ldg(ws + min(row0 + g, N - 1)), s_hi = __ldg(ws + min(row0 + g + 8, N - 1));
        #pragma unroll
        for (int n = 0; n < NT; ++n) { c[n][0] *= s_lo; c[n][1] *= s_lo; c[n][2] *= s_hi; c[n][3] *= s_hi; }
    }
}

// Dense entries: (xq [M, K], sx, ldx, wq [N, K], ws, y, M, N, K, res_in, epi); grid ceil(N/16 / FP8_RT), 256
// threads; epi as gemv_cta.cuh's GEMV_EPI_* (res_in: the residual, may be y).
#define FP8_DENSE(NT)                                                                                         \
    gemv_dense<NT, FP8_RT, FP8_KW>([&](int tile, int kw, float (&c)[NT][4]) {                               \
        fp8_tile_dots<NT>(xq, sx, ldx, wq, ws, M, N, K, tile, kw, true, c);                                   \
    }, y, M, N, res_in, epi)

extern "C" __global__ void __launch_bounds__(FP8_WARPS * 32)
gemv_fp8_n1(const unsigned char* xq, const float* sx, int ldx, const unsigned char* wq, const float* ws, void* y,
            int M, int N, int K, const bf16_t* res_in, int epi) {
    FP8_DENSE(1);
}

extern "C" __global__ void __launch_bounds__(FP8_WARPS * 32)
gemv_fp8_n2(const unsigned char* xq, const float* sx, int ldx, const unsigned char* wq, const float* ws, void* y,
            int M, int N, int K, const bf16_t* res_in, int epi) {
    FP8_DENSE(2);
}

// Grouped (MoE) decode experts on moe_align.cu's expert-grouped rows (as gemv_w4.cu's gemv_w4_grouped):
//   out[r, n] = bf16(the W8A8 product of row r with expert tile_expert[r / tile_m])   (row_token[r] >= 0)
// aq / sa: the grouped rows quantized by fp8_quant (ldx >= their count), wq [E, N, K], ws [E, ...] each
// expert's scales as above. Grid (ceil(N/16 / FP8_RT), tiles).
extern "C" __global__ void __launch_bounds__(FP8_WARPS * 32)
gemv_fp8_grouped(const unsigned char* aq, const float* sa, int ldx, const unsigned char* wq, const float* ws,
                 const int* __restrict__ tile_expert, const int* __restrict__ row_token, bf16_t* out, int N, int K,
                 int tile_m) {
    const size_t ws_expert = FP8_CHANNEL ? (size_t)N : (size_t)((N + 127) / 128) * (K / 128);
    gemv_grouped<FP8_RT, FP8_KW>([&](int r0, int rows, int tile, int kw, float (&c)[2][4]) {
        const size_t e = (size_t)tile_expert[blockIdx.y];
        fp8_tile_dots<2>(aq + (size_t)r0 * K, sa + r0, ldx, wq + e * N * K, ws + e * ws_expert, rows, N, K, tile, kw,
                         false, c);
    }, row_token, tile_m, out, N);
}
