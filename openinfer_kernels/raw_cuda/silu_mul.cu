// SwiGLU activation: out[t, i] = bf16(bf16(silu(gate[t, i])) · up[t, i]) for one gate_up row per token,
// laid out [gate | up] (interleaved = 0) or, as the GPU executor stores the gate_up weight, in blocks of
// 8 columns alternating gate and up: gate[8b..8b+7] then up[8b..8b+7] (interleaved = 1).
// Roofline: reads 2·T·I·2 bytes, writes T·I·2; I = 9728: 58 KB per token (~14 ns). 16-byte vectors.
// silu_mul_limited: DeepSeek-V4's limited SwiGLU (cpu_dsv4_ops.swiglu_limited) in float32, one rounding:
// out = bf16(g · sigmoid(g) · u), g = min(gate, limit), u = clip(up, -limit, limit).
#include "common.cuh"

// The 8-value vector i of row t's gate and up (either layout).
__device__ __forceinline__ void gate_up_vectors(const bf16_t* __restrict__ gate_up, long long t, int i, int inter,
                                                int interleaved, uint4& g, uint4& u) {
    const int vecs_per_row = inter / 8;
    const uint4* row = reinterpret_cast<const uint4*>(gate_up + t * 2 * inter);
    g = interleaved ? row[2 * i] : row[i];
    u = interleaved ? row[2 * i + 1] : row[vecs_per_row + i];
}

extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out,
                                    int inter, long long total_vecs, int interleaved) {
    pdl_begin();
    const int vecs_per_row = inter / 8;
    for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < total_vecs;
         v += (long long)gridDim.x * blockDim.x) {
        const long long t = v / vecs_per_row;
        const int i = (int)(v % vecs_per_row);
        uint4 g, u, o;
        gate_up_vectors(gate_up, t, i, inter, interleaved, g, u);
        const bf16_t* gs = reinterpret_cast<const bf16_t*>(&g);
        const bf16_t* us = reinterpret_cast<const bf16_t*>(&u);
        bf16_t* os = reinterpret_cast<bf16_t*>(&o);
        #pragma unroll
        for (int e = 0; e < 8; ++e) os[e] = silu_times(bf16_to_f(gs[e]), bf16_to_f(us[e]));
        reinterpret_cast<uint4*>(out + t * inter)[i] = o;
    }
}

extern "C" __global__ void silu_mul_limited(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out,
                                            int inter, long long total_vecs, int interleaved, float limit) {
    pdl_begin();
    const int vecs_per_row = inter / 8;
    for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < total_vecs;
         v += (long long)gridDim.x * blockDim.x) {
        const long long t = v / vecs_per_row;
        const int i = (int)(v % vecs_per_row);
        uint4 g, u, o;
        gate_up_vectors(gate_up, t, i, inter, interleaved, g, u);
        const bf16_t* gs = reinterpret_cast<const bf16_t*>(&g);
        const bf16_t* us = reinterpret_cast<const bf16_t*>(&u);
        bf16_t* os = reinterpret_cast<bf16_t*>(&o);
        #pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = fminf(bf16_to_f(gs[e]), limit), b = fminf(fmaxf(bf16_to_f(us[e]), -limit), limit);
            os[e] = f_to_bf16(a * (1.f / (1.f + expf(-a))) * b);
        }
        reinterpret_cast<uint4*>(out + t * inter)[i] = o;
    }
}
