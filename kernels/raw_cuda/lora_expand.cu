// LoRA expand at one packed projection (vLLM V1's lora_expand over a token -> slot map):
//   y[t, c] = bf16(y[t, c] + sum_r buf[t, slice(c)·R + r] · B[s, c, r])   for every token t of slot s,
// buf [T, NR] fp32 from lora_shrink.cu, B [S, N, R] bf16 (slot s's B of every slice in the projection's
// output row order, lora_alpha / r folded in, zero-padded to R ranks, R % 8 == 0), y [T, N] bf16 the
// projection's output, updated in place. slice(c): (c >= b1) + (c >= b2) from the slices' row bounds, or
// with `interleaved` (the GPU's gate_up rows, 8 gate rows then the same 8 up rows) (c / 8) % 2.
// Tokens come grouped by slot through order / starts, as in lora_shrink.cu; tokens without an adapter
// are left alone. Grid (ceil(N / 256), ceil(T / TT), S), 256 threads, TT · NR floats of dynamic shared
// memory (the tile's buf rows): a thread per output column c and the TT tokens of its tile.
// Roofline: each used slot's B is read once per token tile (Qwen3-4B, rank 16: 0.98 MB per layer and
// slot over the four projections, qkv 197 KB, gate_up 623 KB; 35 MB per decode step and slot, ~7 µs at
// 4.8 TB/s) and y is read and written (4 bytes per token and column: 3.9 MB per layer at batch 32,
// launch-bound). An 8192-token prefill moves ~1 GB of y and takes 8 GFLOP (CUDA cores) per layer,
// ~0.2 ms each way, against ~2.6 ms of base GEMMs per layer.
#include "common.cuh"

#define TT 8       // tokens per CTA (lora_shrink.cu's tile)

extern "C" __global__ void __launch_bounds__(256) lora_expand(
        const float* __restrict__ buf, const bf16_t* __restrict__ B, const int* __restrict__ order,
        const int* __restrict__ starts, bf16_t* y, int N, int R, int NR, int b1, int b2, int interleaved) {
    extern __shared__ float rows[];          // [TT, NR]: the tile's shrunk rows
    __shared__ int tok[TT];
    pdl_begin();
    const int s = blockIdx.z;
    const int begin = starts[s] + blockIdx.y * TT;
    const int n = min(starts[s + 1] - begin, TT);
    if (n <= 0) return;
    if (threadIdx.x < TT) tok[threadIdx.x] = order[begin + min((int)threadIdx.x, n - 1)];
    __syncthreads();
    for (int e = threadIdx.x; e < n * NR; e += blockDim.x) rows[e] = buf[(size_t)tok[e / NR] * NR + e % NR];
    __syncthreads();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= N) return;
    const int slice = interleaved ? (c >> 3) & 1 : (c >= b1) + (c >= b2);
    const float* in = rows + slice * R;
    const bf16_t* b = B + ((size_t)s * N + c) * R;
    float acc[TT];
    #pragma unroll
    for (int i = 0; i < TT; ++i) acc[i] = 0.f;
    for (int r = 0; r < R; r += 8) {
        const uint4 bv = *reinterpret_cast<const uint4*>(b + r);
        const bf16_t* bs = reinterpret_cast<const bf16_t*>(&bv);
        #pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float w = bf16_to_f(bs[e]);
            #pragma unroll
            for (int i = 0; i < TT; ++i) acc[i] += in[i * NR + r + e] * w;   // rows past n: unused garbage
        }
    }
    #pragma unroll
    for (int i = 0; i < TT; ++i) {
        if (i < n) {
            bf16_t* p = y + (size_t)tok[i] * N + c;
            *p = f_to_bf16(bf16_to_f(*p) + acc[i]);
        }
    }
}
