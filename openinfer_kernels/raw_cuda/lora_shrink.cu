// LoRA shrink at one packed projection, split in K (vLLM V1's lora_shrink over a token -> slot map):
//   part[c, t, j] = sum over k of chunk c of xn[t, k] · A[s, j, k]    for every token t of slot s, j < NR,
// xn = x, or where norm_w is given RMSNorm(x) · norm_w rounded like rms_norm.cu (the base product fused
// the norm into its own kernel, gemv.cu's "norm" prologue, so the tile's rows are normed here again).
// A [S, NR, K] bf16: slot s's A of every slice of the projection stacked (NR = slices · R, R the padded
// rank; q/k/v or gate/up in one launch), x [T, K] bf16, part [C, T, NR] fp32 with C = ceil(K / KC) chunks
// of K, summed over c by lora_expand.cu. The batch stays in its order: order[starts[s] .. starts[s + 1])
// lists slot s's tokens (built on the host, a static input of the decode graphs); tokens without an
// adapter are in no group and their part rows are left alone.
// Grid (C · ceil(NR / ROWS), ceil(T / TT), S), 256 threads: CTA (chunk, row group, tile, s) takes A rows
// ROWS·group .. (a warp each) over chunk c of K for tokens tile·TT .. of slot s's group, the tile's x
// chunk staged in shared memory; CTAs past their group's end return. Each warp loads its A row before
// the programmatic-launch wait (weights: the previous kernel's tail hides them). K % 8 == 0, KC a
// multiple of 256 up to KC_MAX, rows 16-byte aligned.
// Roofline: every used slot's A is read once per token tile (Qwen3-4B, rank 16: 0.85 MB per layer and
// slot over the four projections, 31 MB per decode step and slot, ~7 µs of HBM at 4.3 TB/s), x from L2;
// a decode step's shrinks are latency-bound, so K is split until the grid fills the GPU (~2-3 µs each).
// FLOPs 2·T·NR·K on CUDA cores: an 8192-token prefill ~0.25 TFLOP (~5 ms) against ~94 ms of base GEMMs.
#include "common.cuh"

#define TT 8          // tokens per CTA: one per warp for the norm's sums of squares
#define ROWS 8        // A rows per CTA: one per warp
#define KC_MAX 1024   // the largest chunk of K a CTA takes

__device__ __forceinline__ float dot8(const float* a, uint4 v) {
    const bf16_t* xs = reinterpret_cast<const bf16_t*>(&v);
    float s = 0.f;
    #pragma unroll
    for (int e = 0; e < 8; ++e) s += a[e] * bf16_to_f(xs[e]);
    return s;
}

extern "C" __global__ void __launch_bounds__(256) lora_shrink(
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ A, const int* __restrict__ order,
        const int* __restrict__ starts, float* __restrict__ part, int T, int K, int NR, int KC,
        const bf16_t* __restrict__ norm_w, float eps) {
    __shared__ __align__(16) bf16_t xs[TT][KC_MAX];
    __shared__ float rstd[TT];
    __shared__ int tok[TT];
    const int s = blockIdx.z;
    const int begin = starts[s] + blockIdx.y * TT;
    const int n = min(starts[s + 1] - begin, TT);
    if (n <= 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (NR + ROWS - 1) / ROWS;
    const int chunk = blockIdx.x / groups, j = (blockIdx.x % groups) * ROWS + warp;
    const int k0 = chunk * KC, kn = min(KC, K - k0);
    uint4 a[KC_MAX / 256];                   // this warp's A row over the chunk: 8 values per lane and pass
    const bf16_t* arow = A + ((size_t)s * NR + min(j, NR - 1)) * K + k0;
    #pragma unroll
    for (int p = 0; p < KC_MAX / 256; ++p) {
        const int k = p * 256 + lane * 8;
        a[p] = k < kn ? *reinterpret_cast<const uint4*>(arow + k) : kZero16;
    }
    if (threadIdx.x < TT) tok[threadIdx.x] = order[begin + min((int)threadIdx.x, n - 1)];  // past n: the last again
    pdl_wait();
    pdl_launch_dependents();
    __syncthreads();
    if (norm_w != nullptr) {                 // warp i: token i's 1 / rms over its whole row
        const bf16_t* row = x + (size_t)tok[warp] * K;
        float ss = 0.f;
        for (int k = lane * 8; k < K; k += 256) {
            const uint4 v = *reinterpret_cast<const uint4*>(row + k);
            const bf16_t* vs = reinterpret_cast<const bf16_t*>(&v);
            #pragma unroll
            for (int e = 0; e < 8; ++e) { const float f = bf16_to_f(vs[e]); ss += f * f; }
        }
        ss = warp_sum(ss);
        if (lane == 0) rstd[warp] = rsqrtf(ss / K + eps);
        __syncthreads();
    }
    const int vecs = kn / 8;
    for (int e = threadIdx.x; e < TT * vecs; e += blockDim.x) {
        const int i = e / vecs, k = (e % vecs) * 8;
        uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)tok[i] * K + k0 + k);
        if (norm_w != nullptr) v = rmsnorm8(v, *reinterpret_cast<const uint4*>(norm_w + k0 + k), rstd[i]);
        *reinterpret_cast<uint4*>(&xs[i][k]) = v;
    }
    __syncthreads();
    if (j >= NR) return;
    float acc[TT];
    #pragma unroll
    for (int i = 0; i < TT; ++i) acc[i] = 0.f;
    #pragma unroll
    for (int p = 0; p < KC_MAX / 256; ++p) {
        const int k = p * 256 + lane * 8;
        if (k < kn) {
            const bf16_t* as = reinterpret_cast<const bf16_t*>(&a[p]);
            float af[8];
            #pragma unroll
            for (int e = 0; e < 8; ++e) af[e] = bf16_to_f(as[e]);
            #pragma unroll
            for (int i = 0; i < TT; ++i) acc[i] += dot8(af, *reinterpret_cast<const uint4*>(&xs[i][k]));
        }
    }
    #pragma unroll
    for (int i = 0; i < TT; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0 && i < n) part[((size_t)chunk * T + tok[i]) * NR + j] = v;
    }
}
