// SwiGLU activation: out[t, i] = bf16(bf16(silu(gate[t, i])) · up[t, i]) for one gate_up row per token,
// laid out [gate | up] (interleaved = 0) or, as the GPU executor stores the gate_up weight, in blocks of
// 8 columns alternating gate and up: gate[8b..8b+7] then up[8b..8b+7] (interleaved = 1).
// Roofline: reads 2·T·I·2 bytes, writes T·I·2; I = 9728: 58 KB per token (~14 ns). 16-byte vectors.
// silu_mul_limited: DeepSeek-V4's limited SwiGLU (cpu_dsv4_ops.swiglu_limited) in float32, one rounding:
// out = bf16(g · sigmoid(g) · u), g = min(gate, limit), u = clip(up, -limit, limit).
#include "common.cuh"

// One output value: silu(gate) · up as silu_mul rounds it, or (LIMITED) the limited form in float32.
template <bool LIMITED>
__device__ __forceinline__ bf16_t activate(bf16_t gate, bf16_t up, float limit) {
    if (!LIMITED) return silu_times(bf16_to_f(gate), bf16_to_f(up));
    const float a = fminf(bf16_to_f(gate), limit), b = fminf(fmaxf(bf16_to_f(up), -limit), limit);
    return f_to_bf16(a * (1.f / (1.f + expf(-a))) * b);
}

// The rows' activations, 8-value vectors over a grid-stride loop; gate_up in either layout.
template <bool LIMITED>
__device__ __forceinline__ void activate_rows(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out,
                                              int inter, long long total_vecs, int interleaved, float limit) {
    const int vecs_per_row = inter / 8;
    for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < total_vecs;
         v += (long long)gridDim.x * blockDim.x) {
        const long long t = v / vecs_per_row;
        const int i = (int)(v % vecs_per_row);
        const uint4* row = reinterpret_cast<const uint4*>(gate_up + t * 2 * inter);
        const uint4 g = interleaved ? row[2 * i] : row[i], u = interleaved ? row[2 * i + 1] : row[vecs_per_row + i];
        uint4 o;
        const bf16_t* gs = reinterpret_cast<const bf16_t*>(&g);
        const bf16_t* us = reinterpret_cast<const bf16_t*>(&u);
        bf16_t* os = reinterpret_cast<bf16_t*>(&o);
        #pragma unroll
        for (int e = 0; e < 8; ++e) os[e] = activate<LIMITED>(gs[e], us[e], limit);
        reinterpret_cast<uint4*>(out + t * inter)[i] = o;
    }
}

extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out,
                                    int inter, long long total_vecs, int interleaved) {
    pdl_begin();
    activate_rows<false>(gate_up, out, inter, total_vecs, interleaved, 0.f);
}

extern "C" __global__ void silu_mul_limited(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out,
                                            int inter, long long total_vecs, int interleaved, float limit) {
    pdl_begin();
    activate_rows<true>(gate_up, out, inter, total_vecs, interleaved, limit);
}
