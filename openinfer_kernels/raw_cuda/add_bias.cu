// Bias add after a GEMM: y[t, n] = bf16(y[t, n] + b[n]), in place.
// Roofline: 2·T·N·2 bytes plus N·2; tiny (Qwen2 q/k/v bias only).
#include "common.cuh"

extern "C" __global__ void add_bias(bf16_t* __restrict__ y, const bf16_t* __restrict__ b, int n, long long total) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = f_to_bf16(bf16_to_f(y[i]) + bf16_to_f(b[i % n]));
}

// Residual add: out[i] = bf16(x[i] + residual[i]), 8 elements per 16-byte vector (total_vecs of them);
// out may be residual. Roofline: 3 x 2 bytes per element (the large-T path only: decode fuses this
// into the GEMV epilogue).
extern "C" __global__ void residual_add(const bf16_t* __restrict__ x, const bf16_t* residual, bf16_t* out,
                                        long long total_vecs) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total_vecs;
         i += (long long)gridDim.x * blockDim.x) {
        uint4 a = reinterpret_cast<const uint4*>(x)[i], r = reinterpret_cast<const uint4*>(residual)[i];
        bf16_t* as = reinterpret_cast<bf16_t*>(&a);
        const bf16_t* rs = reinterpret_cast<const bf16_t*>(&r);
        #pragma unroll
        for (int e = 0; e < 8; ++e) as[e] = f_to_bf16(bf16_to_f(as[e]) + bf16_to_f(rs[e]));
        reinterpret_cast<uint4*>(out)[i] = a;
    }
}
