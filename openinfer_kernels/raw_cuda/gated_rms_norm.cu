// Gated RMSNorm of a Gated DeltaNet layer's output, per value head (rows of Dv values):
//   out[t, h] = bf16(bf16(w · bf16(x · rsqrt(mean(x²) + eps))) · silu(z[t, h]))
// rounding like HF's Qwen3_5RMSNormGated in bf16 (the norm rounds to bf16, the weight product rounds,
// the gate's SiLU stays float32 until the final rounding). x: [T, Hv·Dv] (the delta rule's output);
// z: the input projection's z columns, row stride z_stride. One warp per (token, head) row, 4 rows per
// 128-thread block. Roofline: reads 2·T·Hv·Dv·2 bytes, writes T·Hv·Dv·2: Qwen3.5-4B (4096 values per
// token) 24 KB per token (~6 ns): launch-bound at decode.
#include "common.cuh"

extern "C" __global__ void gated_rms_norm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ z, int z_stride,
                                          const bf16_t* __restrict__ w, bf16_t* __restrict__ out, int rows,
                                          int Hv, int Dv, float eps) {
    pdl_begin();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int t = row / Hv, h = row % Hv;
    const bf16_t* xr = x + (size_t)row * Dv;
    const bf16_t* zr = z + (size_t)t * z_stride + h * Dv;
    float ss = 0.f;
    for (int i = lane; i < Dv; i += 32) { const float f = bf16_to_f(xr[i]); ss += f * f; }
    const float rstd = rsqrtf(warp_sum(ss) / Dv + eps);
    bf16_t* orow = out + (size_t)row * Dv;
    for (int i = lane; i < Dv; i += 32) {
        const float y = round_bf16(bf16_to_f(w[i]) * round_bf16(bf16_to_f(xr[i]) * rstd));
        const float g = bf16_to_f(zr[i]);
        orow[i] = f_to_bf16(y * (g / (1.f + __expf(-g))));
    }
}
