// Activations to FP8 e4m3 per token and 128-wide group (the A side of W8A8: gemv_fp8.cu, the CuTe FP8 GEMM):
//   s[kb·ld + m] = max(amax_k |v[m, k]|, 1e-10) / 448           over k in [128·kb, 128·kb + 128)
//   q[m, k]      = e4m3(v[m, k] / s)                           (IEEE division, nearest even, saturated to ±448)
// vLLM's per_token_group_quant_fp8 arithmetic, float32 scales (DeepGEMM's Hopper format), stored MN-major
// ([K/128][ld], ld >= M: a k-block's scales of consecutive tokens are contiguous, as the GEMM loads them).
//   fp8_quant:                   v = x (bf16 [M, K])
//   rms_norm_residual_fp8_quant: r = bf16(x + residual) (written to resid_out; no residual: r = x), then
//                                v = bf16(w · bf16(r · rsqrt(mean(r²) + eps))): rms_norm.cu's arithmetic, so
//                                the output is bit for bit rms_norm_residual followed by fp8_quant.
// One CTA per token, a thread per 8 values (K % 128 == 0): a group is the 16 threads of a half warp, its
// amax four shuffles away. Roofline: reads 2·M·K (+ 2·M·K residual), writes M·K + 4·M·K/128 (+ 2·M·K):
// M = 16, K = 4096 is ~0.2 MB, far below a microsecond: launch-bound, one launch fewer when fused.
#include "common.cuh"
#include "fp8.cuh"

#define QUANT_GROUP 128
#define QUANT_EPS 1e-10f

// Quantizes 8-value vector i (of nvec) of one row; every lane of the warp calls it (the shuffles), the
// lanes past the row's end with active = false.
__device__ __forceinline__ void quant_vector(uint4 v, bool active, int i, unsigned char* q_row, float* s, int ld,
                                             int m) {
    const bf16_t* vs = reinterpret_cast<const bf16_t*>(&v);
    float f[8], amax = 0.f;
    #pragma unroll
    for (int e = 0; e < 8; ++e) { f[e] = bf16_to_f(vs[e]); amax = fmaxf(amax, fabsf(f[e])); }
    #pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));   // the half warp
    if (!active) return;
    const float scale = fmaxf(amax, QUANT_EPS) / E4M3_MAX;
    uint2 out;
    out.x = e4m3x2(f[0] / scale, f[1] / scale) | (unsigned)e4m3x2(f[2] / scale, f[3] / scale) << 16;
    out.y = e4m3x2(f[4] / scale, f[5] / scale) | (unsigned)e4m3x2(f[6] / scale, f[7] / scale) << 16;
    reinterpret_cast<uint2*>(q_row)[i] = out;
    if (i % (QUANT_GROUP / 8) == 0) s[(size_t)(i / (QUANT_GROUP / 8)) * ld + m] = scale;
}

// Grid (M), blockDim a multiple of 32.
extern "C" __global__ void fp8_quant(const bf16_t* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ s,
                                     int K, int ld) {
    pdl_begin();
    const int m = blockIdx.x, nvec = K / 8;
    const uint4* row = reinterpret_cast<const uint4*>(x + (size_t)m * K);
    for (int base = 0; base < nvec; base += blockDim.x) {
        const int i = base + threadIdx.x;
        quant_vector(i < nvec ? row[i] : make_uint4(0, 0, 0, 0), i < nvec, i, q + (size_t)m * K, s, ld, m);
    }
}

extern "C" __global__ void rms_norm_residual_fp8_quant(const bf16_t* __restrict__ x, const bf16_t* __restrict__ residual,
                                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ resid_out,
                                                       unsigned char* __restrict__ q, float* __restrict__ s, int K,
                                                       int ld, float eps) {
    pdl_begin();
    __shared__ float scratch[33];
    const int m = blockIdx.x, nvec = K / 8;
    const size_t row = (size_t)m * K;
    const float rstd = rsqrtf(block_sum(residual_row_sum_squares(x + row, residual ? residual + row : nullptr,
                                                                 resid_out + row, nvec), scratch) / K + eps);
    const uint4* r = reinterpret_cast<const uint4*>((residual != nullptr ? resid_out : x) + row);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    for (int base = 0; base < nvec; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool active = i < nvec;
        quant_vector(active ? rmsnorm8(r[i], wv[i], rstd) : make_uint4(0, 0, 0, 0), active, i, q + row, s, ld, m);
    }
}
