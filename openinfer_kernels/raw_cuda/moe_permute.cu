// The permutation around the grouped expert GEMMs (rows from moe_align.cu):
//   moe_gather:  out[r] = x[row_token[r]]            (padding rows, row_token < 0, are left as they are)
//   moe_combine: out[t] = bf16(residual[t] + sum_j weights[t, j] · y[row_of[t·top_k + j]])
//                (fp32 sum in slot order, so deterministic; dropped assignments, row_of < 0, add nothing;
//                out may be residual itself: each element is read before it is written, by one thread).
// Rows are bf16 [., H], H % 8 == 0, 16-byte vectors; one CTA per row (gather) or token (combine).
// Roofline: gather moves 2·rows·H·2 bytes, combine reads (top_k + 1)·T·H·2 and writes T·H·2 bytes:
// decode batch 32 of Qwen3-30B-A3B (H 2048, top 8) ~1.2 MB each, ~0.3 µs at 4.3 TB/s: launch-bound;
// an 8K-token prefill ~300 MB, ~70 µs, against ~2 ms of expert GEMMs.
#include "common.cuh"

extern "C" __global__ void moe_gather(const bf16_t* __restrict__ x, const int* __restrict__ row_token,
                                      bf16_t* __restrict__ out, int hidden) {
    pdl_begin();
    const int t = row_token[blockIdx.x];
    if (t < 0) return;
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)t * hidden);
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)blockIdx.x * hidden);
    for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void moe_combine(const bf16_t* __restrict__ y, const int* __restrict__ row_of,
                                       const float* __restrict__ weights, const bf16_t* residual,
                                       bf16_t* out, int hidden, int top_k) {
    pdl_begin();
    const size_t t = blockIdx.x;
    for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < top_k; ++j) {
            const int r = row_of[t * top_k + j];
            if (r < 0) continue;
            const float w = weights[t * top_k + j];
            uint4 v = reinterpret_cast<const uint4*>(y + (size_t)r * hidden)[i];
            const bf16_t* vs = reinterpret_cast<const bf16_t*>(&v);
            #pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += w * bf16_to_f(vs[e]);
        }
        uint4 rv = reinterpret_cast<const uint4*>(residual + t * hidden)[i];
        bf16_t* rs = reinterpret_cast<bf16_t*>(&rv);
        #pragma unroll
        for (int e = 0; e < 8; ++e) rs[e] = f_to_bf16(bf16_to_f(rs[e]) + acc[e]);
        reinterpret_cast<uint4*>(out + t * hidden)[i] = rv;
    }
}
