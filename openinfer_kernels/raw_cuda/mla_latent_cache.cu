// MLA prologue (DeepSeek-V2), one CTA per token t of the fused down-projection row
// y[t] = [q part (q_cols) | latent c (R) | rope key (Dr)]: the latent and rope key into the paged cache, the
// query columns out (mla_latent.cuh says how). The paged cache of an MLA layer is one plane of one head:
// R + Dr values per token (576 on V2-Lite), bf16 (mla_latent_cache) or e4m3 of value / scale
// (mla_latent_cache_fp8, --kv-cache-dtype fp8).
// Roofline: reads (q_cols + R + Dr)·2 bytes per token and writes as many (the cache's part: half with FP8)
// (V2-Lite: 3.2 KB read, 3.2 KB written); launch-bound at decode, ~1 µs per 1K tokens of prefill.
#include "mla_latent.cuh"

#define THREADS 128

template <bool FP8>
__device__ __forceinline__ void latent_cache(const bf16_t* __restrict__ y, int q_cols, int R, int Dr,
                                             const bf16_t* __restrict__ kv_norm, const bf16_t* __restrict__ q_norm,
                                             float eps, const float* __restrict__ inv_freq, float attn_factor,
                                             const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                             void* __restrict__ cache, bf16_t* __restrict__ q_out, float scale) {
    pdl_begin();
    __shared__ float scratch[33];
    const size_t t = blockIdx.x;
    mla_latent_row<FP8>(y + t * (q_cols + R + Dr), q_cols, R, Dr, kv_norm, q_norm, eps, inv_freq, attn_factor,
                        (float)positions[t], slot_mapping[t], cache, scale, q_out + t * q_cols, scratch);
}

extern "C" __global__ void __launch_bounds__(THREADS)
mla_latent_cache(const bf16_t* __restrict__ y, int q_cols, int R, int Dr, const bf16_t* __restrict__ kv_norm,
                 const bf16_t* __restrict__ q_norm, float eps, const float* __restrict__ inv_freq, float attn_factor,
                 const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                 bf16_t* __restrict__ cache, bf16_t* __restrict__ q_out) {
    latent_cache<false>(y, q_cols, R, Dr, kv_norm, q_norm, eps, inv_freq, attn_factor, positions, slot_mapping, cache,
                        q_out, 1.f);
}

extern "C" __global__ void __launch_bounds__(THREADS)
mla_latent_cache_fp8(const bf16_t* __restrict__ y, int q_cols, int R, int Dr, const bf16_t* __restrict__ kv_norm,
                     const bf16_t* __restrict__ q_norm, float eps, const float* __restrict__ inv_freq,
                     float attn_factor, const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                     unsigned char* __restrict__ cache, bf16_t* __restrict__ q_out, float scale) {
    latent_cache<true>(y, q_cols, R, Dr, kv_norm, q_norm, eps, inv_freq, attn_factor, positions, slot_mapping, cache,
                       q_out, scale);
}
