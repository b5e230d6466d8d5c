// MLA prologue (DeepSeek-V2), one CTA per token t of the fused down-projection row
// y[t] = [q part (q_cols) | latent c (R) | rope key (Dr)]: the latent and rope key into the paged cache, the
// query columns out (mla_latent.cuh says how). The paged cache of an MLA layer is one plane of one head:
// R + Dr values per token (576 on V2-Lite).
// Roofline: reads and writes (q_cols + R + Dr)·2 bytes per token (V2-Lite: 3.2 KB read, 3.2 KB
// written); launch-bound at decode, ~1 µs per 1K tokens of prefill.
#include "mla_latent.cuh"

#define THREADS 128

extern "C" __global__ void __launch_bounds__(THREADS)
mla_latent_cache(const bf16_t* __restrict__ y, int q_cols, int R, int Dr, const bf16_t* __restrict__ kv_norm,
                 const bf16_t* __restrict__ q_norm, float eps, const float* __restrict__ inv_freq, float attn_factor,
                 const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                 bf16_t* __restrict__ cache, bf16_t* __restrict__ q_out) {
    pdl_begin();
    __shared__ float scratch[33];
    const size_t t = blockIdx.x;
    mla_latent_row(y + t * (q_cols + R + Dr), q_cols, R, Dr, kv_norm, q_norm, eps, inv_freq, attn_factor,
                   (float)positions[t], slot_mapping[t], cache, q_out + t * q_cols, scratch);
}
