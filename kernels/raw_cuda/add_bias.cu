// Bias add after a GEMM: y[t, n] = bf16(y[t, n] + b[n]), in place.
// Roofline: 2·T·N·2 bytes plus N·2; tiny (Qwen2 q/k/v bias only).
#include "common.cuh"

extern "C" __global__ void add_bias(bf16_t* __restrict__ y, const bf16_t* __restrict__ b, int n, long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = f_to_bf16(bf16_to_f(y[i]) + bf16_to_f(b[i % n]));
}
