// The gated attention's output gate: out[i] = bf16(x[i] · bf16(sigmoid(gate[i]))) over T·n values
// (bf16 like HF's attn_output * torch.sigmoid(gate): the sigmoid rounds, then the product).
// 16-byte vectors (n % 8 == 0), grid-stride. Roofline: reads 2·T·n·2 bytes, writes T·n·2: Qwen3.5-4B
// (n = 16 · 256 = 4096) 24 KB per token: launch-bound at decode.
#include "common.cuh"

extern "C" __global__ void sigmoid_gate(const bf16_t* __restrict__ x, const bf16_t* __restrict__ gate,
                                        bf16_t* __restrict__ out, long long total_vecs) {
    pdl_begin();
    for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < total_vecs;
         v += (long long)gridDim.x * blockDim.x) {
        const uint4 xv = reinterpret_cast<const uint4*>(x)[v], gv = reinterpret_cast<const uint4*>(gate)[v];
        uint4 o;
        const bf16_t* xs = reinterpret_cast<const bf16_t*>(&xv);
        const bf16_t* gs = reinterpret_cast<const bf16_t*>(&gv);
        bf16_t* os = reinterpret_cast<bf16_t*>(&o);
        #pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float s = round_bf16(1.f / (1.f + __expf(-bf16_to_f(gs[e]))));
            os[e] = f_to_bf16(bf16_to_f(xs[e]) * s);
        }
        reinterpret_cast<uint4*>(out)[v] = o;
    }
}
