// DeepSeek-V4's per-head RMSNorm and partial interleaved rope, in place, in one launch (cpu_dsv4_ops.rms then
// rope_trailing, with cpu_dsv4_attention.cos_sin's angles): rows x float32 [T · heads, d] (row r: token r / heads)
//   norm (eps >= 0):  x = x / sqrt(mean(x²) + eps) · w   (w: float32 [d], or null for none)
//   rope:             the trailing 2·half values' pairs (2i, 2i + 1) rotated by sign · positions[t] · inv_freq[i]
//                     (sign -1: the rope undone, the attention output's); position -1 (padding) rotates by 0.
// The attention's projections run it on q (64 heads of 512 at V4-Flash), the K = V row (norm with its weight), the
// indexer's queries (rope only) and the output (inverse rope): where numpy composes ~15 elementwise kernels (and
// the angles' own), the device launches one.
//
// One CTA of NR_THREADS per row, each thread NR_PER values of it (d <= NR_THREADS · NR_PER). Roofline: 2 · 4 · d
// bytes per row read and written (V4-Flash's q of a token: 256 KB, ~0.1 µs at 3 TB/s): launch-bound at decode.
// Full-precision sincosf: positions reach a million and the angles as many radians.
#include "common.cuh"

#define NR_THREADS 128
#define NR_PER 8

extern "C" __global__ void __launch_bounds__(NR_THREADS)
norm_rope(float* __restrict__ x, const float* __restrict__ weight, const int* __restrict__ positions,
          const float* __restrict__ inv_freq, int heads, int d, int half, float eps, float sign) {
    pdl_begin();
    __shared__ float scratch[33];
    const int row = blockIdx.x, t = row / heads;
    float* r = x + (size_t)row * d;
    float v[NR_PER];
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < NR_PER; ++j) {
        const int c = threadIdx.x + j * NR_THREADS;
        v[j] = c < d ? r[c] : 0.f;
        sq += v[j] * v[j];
    }
    float scale = 1.f;
    if (eps >= 0.f) scale = 1.f / sqrtf(block_sum(sq, scratch) / (float)d + eps);
    const int first = d - 2 * half;
    const float pos = (float)max(positions[t], 0);
#pragma unroll
    for (int j = 0; j < NR_PER; ++j) {
        const int c = threadIdx.x + j * NR_THREADS;
        if (c < d) r[c] = eps >= 0.f && weight != nullptr ? v[j] * scale * weight[c] : v[j] * scale;
    }
    __syncthreads();                       // the normed row written: the rope's pairs cross threads
    for (int i = threadIdx.x; i < half; i += NR_THREADS) {
        const int c = first + 2 * i;
        float s, co;
        sincosf(pos * inv_freq[i], &s, &co);
        s *= sign;
        const float a = r[c], b = r[c + 1];
        r[c] = a * co - b * s;
        r[c + 1] = b * co + a * s;
    }
}
