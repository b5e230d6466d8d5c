// LoRA shrink at one packed projection (vLLM V1's lora_shrink over a token -> slot map):
//   buf[t, j] = sum_k x[t, k] · A[s, j, k]    for every token t whose adapter slot is s, j < NR,
// A [S, NR, K] bf16: slot s's A of every slice of the projection stacked (NR = slices · R, R the padded
// rank; q/k/v or gate/up in one launch), x [T, K] bf16, buf [T, NR] fp32. The batch stays in its order:
// order[starts[s] .. starts[s + 1]) lists slot s's tokens (built on the host, a static input of the decode
// graphs); tokens without an adapter are in no group and their buf rows are left alone.
// Grid (ceil(NR / ROWS), ceil(T / TT), S), 256 threads: CTA (r, tile, s) takes A rows ROWS·r .. (a warp
// each, 16-byte loads over K) for tokens tile·TT .. of slot s's group; CTAs past their group's end return.
// K % 8 == 0, rows 16-byte aligned.
// Roofline: each used slot's A is read once per token tile, x from L2. Qwen3-4B, rank 16: A is 0.85 MB
// per layer and slot over the four projections (qkv 246 KB, o 131, gate_up 164, down 311), 31 MB per
// decode step and slot: ~6.4 µs of HBM per slot at 4.8 TB/s, so a decode step is launch-bound (36 x 4
// launches). FLOPs 2·T·NR·K: an 8192-token prefill takes 0.25 TFLOP on CUDA cores (~5.6 ms at ~45
// TFLOP/s) and re-reads x from L2 once per 8-row CTA (~31 GB, ~3 ms), against 65 TFLOP of base GEMMs
// (~94 ms): ~6-9%.
#include "common.cuh"

#define TT 8       // tokens per CTA
#define ROWS 8     // A rows per CTA: one per warp

__device__ __forceinline__ float dot8(const float* a, uint4 v) {
    const bf16_t* xs = reinterpret_cast<const bf16_t*>(&v);
    float s = 0.f;
    #pragma unroll
    for (int e = 0; e < 8; ++e) s += a[e] * bf16_to_f(xs[e]);
    return s;
}

extern "C" __global__ void __launch_bounds__(256) lora_shrink(
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ A, const int* __restrict__ order,
        const int* __restrict__ starts, float* __restrict__ buf, int K, int NR) {
    pdl_begin();
    const int s = blockIdx.z;
    const int begin = starts[s] + blockIdx.y * TT;
    const int n = min(starts[s + 1] - begin, TT);
    const int j = blockIdx.x * ROWS + (threadIdx.x >> 5);
    if (n <= 0 || j >= NR) return;
    const int lane = threadIdx.x & 31;
    int tok[TT];
    #pragma unroll
    for (int i = 0; i < TT; ++i) tok[i] = order[begin + min(i, n - 1)];   // past n: the last token again
    float acc[TT];
    #pragma unroll
    for (int i = 0; i < TT; ++i) acc[i] = 0.f;
    const bf16_t* a = A + ((size_t)s * NR + j) * K;
    for (int k = lane * 8; k < K; k += 256) {
        const uint4 av = *reinterpret_cast<const uint4*>(a + k);
        const bf16_t* as = reinterpret_cast<const bf16_t*>(&av);
        float af[8];
        #pragma unroll
        for (int e = 0; e < 8; ++e) af[e] = bf16_to_f(as[e]);
        #pragma unroll
        for (int i = 0; i < TT; ++i)
            acc[i] += dot8(af, *reinterpret_cast<const uint4*>(x + (size_t)tok[i] * K + k));
    }
    #pragma unroll
    for (int i = 0; i < TT; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0 && i < n) buf[(size_t)tok[i] * NR + j] = v;
    }
}
