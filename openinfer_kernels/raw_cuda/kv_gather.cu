// Paged KV -> contiguous K/V rows, for attention kernels that read packed sequences (openinfer_kernels/cute
// varlen_attention). For each sequence b of a launch and each position p < cu_k[b+1] - cu_k[b]:
//   k_out[cu_k[b] + p] = k_cache[block_tables[b][p / 16] * 16 + p % 16]   (and the same for V),
// one row being Hkv·D bf16 (row_vecs 16-byte vectors). Grid (max blocks of a sequence, sequences),
// 256 threads: CTA (x, b) copies 16-token block x of sequence b, which is 16 consecutive cache slots
// and 16 consecutive output rows, so both sides are one contiguous run of 16-byte vectors; CTAs past
// a sequence's end exit.
// kv_gather_fp8: the same from an e4m3 cache (kv_fp8.cuh), each 8-value piece (8 bytes) widened to bf16 of
// e4m3 · scale on the way (the CuTe prefill attention reads bf16): reads half the bytes, writes the same.
// Roofline: bytes = 2 (K, V) x 2 (read + write) x sum(context) x Hkv x D x 2; Qwen3-4B (Hkv 8, D 128)
// at 4096 keys: 33.6 MB per layer, 7.8 us at 4.3 TB/s (the attention over them: ~0.27 ms at 500 TFLOP/s).
#include "common.cuh"
#include "kv_fp8.cuh"   // e4m3x8_to_bf16x8

#define BLOCK 16

// k_cache, v_cache [slots x row_vecs] of Piece (8 values: bf16 uint4, or e4m3 uint2 widened to bf16 of e4m3 ·
// scale); block_tables [sequences x table_width]; cu_k [sequences + 1]; k_out, v_out [cu_k[-1] x row_vecs] (no
// commas in the entries' parameter lists' comments: the host emulation parses them).
template <typename Piece>
__device__ __forceinline__ void gather(const Piece* __restrict__ k_cache, const Piece* __restrict__ v_cache,
                                       const int* __restrict__ block_tables, int table_width,
                                       const int* __restrict__ cu_k, uint4* __restrict__ k_out,
                                       uint4* __restrict__ v_out, int row_vecs, float k_scale, float v_scale) {
    pdl_wait();
    const int b = blockIdx.y, first = blockIdx.x * BLOCK;
    const int row0 = cu_k[b], len = cu_k[b + 1] - row0;
    if (first >= len) return;
    const int tokens = min(BLOCK, len - first);
    const long long src = (long long)block_tables[(long long)b * table_width + blockIdx.x] * BLOCK * row_vecs;
    const long long dst = (long long)(row0 + first) * row_vecs;
    const int n = tokens * row_vecs;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const Piece k = k_cache[src + i], v = v_cache[src + i];
        if constexpr (sizeof(Piece) == 16) {
            k_out[dst + i] = k;
            v_out[dst + i] = v;
        } else {
            k_out[dst + i] = e4m3x8_to_bf16x8(k, k_scale);
            v_out[dst + i] = e4m3x8_to_bf16x8(v, v_scale);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) kv_gather(
    const uint4* __restrict__ k_cache, const uint4* __restrict__ v_cache,
    const int* __restrict__ block_tables, int table_width, const int* __restrict__ cu_k,
    uint4* __restrict__ k_out, uint4* __restrict__ v_out, int row_vecs) {
    gather(k_cache, v_cache, block_tables, table_width, cu_k, k_out, v_out, row_vecs, 1.f, 1.f);
}

extern "C" __global__ void __launch_bounds__(256) kv_gather_fp8(
    const uint2* __restrict__ k_cache, const uint2* __restrict__ v_cache,
    const int* __restrict__ block_tables, int table_width, const int* __restrict__ cu_k,
    uint4* __restrict__ k_out, uint4* __restrict__ v_out, int row_vecs, float k_scale, float v_scale) {
    gather(k_cache, v_cache, block_tables, table_width, cu_k, k_out, v_out, row_vecs, k_scale, v_scale);
}
