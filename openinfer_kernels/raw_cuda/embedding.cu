// Row gather: out[t, :] = table[ids[t], :]   (bf16 rows, H % 8 == 0): the embedding lookup, and the
// gather of the rows whose logits are sampled.
// Roofline: pure copy, 2·T·H·2 bytes (read + write); at 4.3 TB/s a 2560-wide row is ~2.4 ns,
// so even T = 8192 is ~20 µs. One block per token, 16-byte vector copies.
#include "common.cuh"

extern "C" __global__ void embedding_gather(const bf16_t* __restrict__ table, const int* __restrict__ ids,
                                            bf16_t* __restrict__ out, int hidden) {
    pdl_begin();
    const int t = blockIdx.x;
    const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)ids[t] * hidden);
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)t * hidden);
    for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = src[i];
}
