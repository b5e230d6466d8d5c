// Fused residual add + RMSNorm, rounding like the bf16 reference:
//   r = bf16(x + residual)            (or r = x when there is no residual)
//   out = bf16(w * bf16(r / sqrt(mean(r²) + eps)))
// Roofline: reads x, residual, w and writes r, out: ~4·T·H·2 bytes; T=1, H=2560 is 20 KB (~5 ns of
// bandwidth, so launch-bound at decode); one block per row, 16-byte vectors, fp32 accumulation.
#include "common.cuh"

extern "C" __global__ void rms_norm_residual(const bf16_t* __restrict__ x, const bf16_t* __restrict__ residual,
                                             const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                                             bf16_t* __restrict__ resid_out, int hidden, float eps) {
    pdl_begin();
    __shared__ float scratch[33];
    const size_t row = (size_t)blockIdx.x * hidden;
    const int nvec = hidden / 8;
    float ss = 0.f;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        uint4 xv = reinterpret_cast<const uint4*>(x + row)[i];
        bf16_t* xs = reinterpret_cast<bf16_t*>(&xv);
        if (residual != nullptr) {
            uint4 rv = reinterpret_cast<const uint4*>(residual + row)[i];
            const bf16_t* rs = reinterpret_cast<const bf16_t*>(&rv);
            #pragma unroll
            for (int e = 0; e < 8; ++e) xs[e] = f_to_bf16(bf16_to_f(xs[e]) + bf16_to_f(rs[e]));
            reinterpret_cast<uint4*>(resid_out + row)[i] = xv;
        }
        #pragma unroll
        for (int e = 0; e < 8; ++e) { float f = bf16_to_f(xs[e]); ss += f * f; }
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    const bf16_t* src = residual != nullptr ? resid_out : x;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        reinterpret_cast<uint4*>(out + row)[i] = rmsnorm8(reinterpret_cast<const uint4*>(src + row)[i],
                                                          reinterpret_cast<const uint4*>(w)[i], rstd);
    }
}
