// DeepSeek-V4's manifold-constrained hyper-connections (engine/executor/cpu_dsv4_ops.py hyper_connection /
// hc_merge / hyper_head, transformers' DeepseekV4HyperConnection and DeepseekV4HyperHead), float32 math as the
// numpy reference does it, no host reads (fixed shapes per launch: graph-capturable). N = HC_N residual
// streams of D values per token, held float32 [T, N, D]; the weights bf16 (fn [M, N·D]) and float32 (base [M],
// scale [3] or [1]), M = (2 + N)·N mixes (N for the head). N <= 5: the comb matrix lives in one warp's lanes.
//
// The mixes of a token row are split over the grid's x: CTA s takes HC_CHUNK values of the flat row (its
// sum of squares and its M dot products with fn's rows), writes them to `partial`, and the CTA that finishes
// last (a per-row counter it resets for the next launch) sums the S slices in order (results independent of
// the batch) and finishes the row: rms factored out of the products (mix = rstd · x · fn), the weights in
// warp 0, the collapse by every thread. One CTA per row when N·D <= HC_CHUNK.
#include "common.cuh"

#ifndef HC_N
#define HC_N 4
#endif
#define HC_THREADS 256                      // hc_pre / hc_head: a float4 of the slice a thread, the collapse's loads
                                            // of the one finishing CTA over 8 warps (4 at 128: 18 µs a batch-1 call)
#define HC_POST_THREADS 128                 // hc_merge
#define HC_CHUNK 1024                       // flat-row values per CTA of the mixes
#define HC_MIX ((2 + HC_N) * HC_N)
#define HC_MAX_SLICES 64                    // slices a row at most (N·D <= 65,536: checked at start), their
                                            // partials staged in the finishing CTA's shared memory

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const bf16_t* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return float4{__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                  __uint_as_float(v.y & 0xffff0000u)};
}
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// sums[0..M) = x[k0..k1) · fn[m, k0..k1), sums[M] = sum of x² over the slice (shared, every thread sees them).
template <int M>
__device__ __forceinline__ void slice_sums(const float* __restrict__ x, const bf16_t* __restrict__ fn, int ND,
                                           int k0, int k1, float* sums) {
    __shared__ float part[HC_THREADS / 32][HC_MIX + 1];
    float acc[M + 1];
    #pragma unroll
    for (int m = 0; m <= M; ++m) acc[m] = 0.f;
    for (int k = k0 + 4 * threadIdx.x; k < k1; k += 4 * blockDim.x) {
        const float4 v = load4(x + k);
        acc[M] += dot4(v, v);
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[m] += dot4(v, load4(fn + (size_t)m * ND + k));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
    for (int m = 0; m <= M; ++m) {
        const float s = warp_sum(acc[m]);
        if (lane == 0) part[warp][m] = s;
    }
    __syncthreads();
    if (threadIdx.x <= M) {
        float s = 0.f;
        for (int w = 0; w < (int)blockDim.x / 32; ++w) s += part[w][threadIdx.x];
        sums[threadIdx.x] = s;
    }
    __syncthreads();
}

// The whole row's sums in `sums` for the CTA that finishes row blockIdx.y (returns true there, false in the
// others): its own slice when the grid has one CTA a row, else the S slices' partials summed in order.
// partial: float32 [T, S, M + 1]; counter: int32 [T], zero, left zero.
template <int M>
__device__ bool row_sums(const float* __restrict__ x, const bf16_t* __restrict__ fn, int ND, float* partial,
                         int* counter, float* sums) {
    const int s = blockIdx.x, S = gridDim.x, t = blockIdx.y;
    slice_sums<M>(x, fn, ND, s * HC_CHUNK, min(ND, (s + 1) * HC_CHUNK), sums);
    if (S == 1) return true;
    float* row = partial + (size_t)t * S * (M + 1);
    if (threadIdx.x <= M) row[s * (M + 1) + threadIdx.x] = sums[threadIdx.x];
    __shared__ int last;
    __threadfence();                        // this CTA's partials reach L2 before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter + t, 1) == S - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    // the slices' partials loaded by every thread at once, then summed in slice order
    __shared__ float staged[HC_MAX_SLICES * (M + 1)];
    for (int i = threadIdx.x; i < S * (M + 1); i += blockDim.x) staged[i] = __ldcg(row + i);
    __syncthreads();
    if (threadIdx.x <= M) {
        float v = 0.f;
        for (int j = 0; j < S; ++j) v += staged[j * (M + 1) + threadIdx.x];
        sums[threadIdx.x] = v;
    }
    if (threadIdx.x == 0) counter[t] = 0;
    __syncthreads();
    return true;
}

// 1 / sqrt(mean(x²) + eps) of the N·D values, as cpu_dsv4_ops.rms.
__device__ __forceinline__ float row_rstd(float sum_sq, int ND, float eps) { return 1.f / sqrtf(sum_sq / ND + eps); }

// collapsed[d] = bf16(sum_n pre[n] · x[n, d]) (x: one token's N streams).
__device__ __forceinline__ void collapse(const float* __restrict__ x, const float* pre, int D,
                                         bf16_t* __restrict__ out) {
    for (int d = 4 * threadIdx.x; d < D; d += 4 * blockDim.x) {
        float4 y = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int n = 0; n < HC_N; ++n) {
            const float4 v = load4(x + (size_t)n * D + d);
            y.x += pre[n] * v.x, y.y += pre[n] * v.y, y.z += pre[n] * v.z, y.w += pre[n] * v.w;
        }
        *reinterpret_cast<uint2*>(out + d) = uint2{f_to_bf16(y.x) | (unsigned)f_to_bf16(y.y) << 16,
                                                   f_to_bf16(y.z) | (unsigned)f_to_bf16(y.w) << 16};
    }
}

// Sum of the warp's v over the lanes first + k·step, k < N, in k order (through shared memory: every lane).
__device__ __forceinline__ float lanes_sum(float v, float* lanes, int first, int step) {
    lanes[threadIdx.x] = v;
    __syncwarp();
    float s = 0.f;
    #pragma unroll
    for (int k = 0; k < HC_N; ++k) s += lanes[first + k * step];
    __syncwarp();
    return s;
}

// Warp 0: pre (shared) and the row's post [N] and comb [N, N] from its mixes sums · rstd (cpu_dsv4_ops.hc_weights):
// lane i·N + j holds comb[i, j]; softmax over j, + eps, columns normalized, then iters - 1 times rows and columns.
__device__ __forceinline__ void hc_weights(const float* sums, float rstd, const float* __restrict__ base,
                                           const float* __restrict__ scale, int iters, float eps, float* pre,
                                           float* __restrict__ post, float* __restrict__ comb) {
    __shared__ float lanes[32];
    const int lane = threadIdx.x, NN = HC_N * HC_N;
    if (lane < HC_N) {
        pre[lane] = sigmoid(sums[lane] * rstd * scale[0] + base[lane]) + eps;
        post[lane] = 2.f * sigmoid(sums[HC_N + lane] * rstd * scale[1] + base[HC_N + lane]);
    }
    const int l = lane < NN ? lane : 0, i = l / HC_N, j = l % HC_N;
    const float logit = sums[2 * HC_N + l] * rstd * scale[2] + base[2 * HC_N + l];
    lanes[lane] = logit;
    __syncwarp();
    float mx = -INFINITY;
    #pragma unroll
    for (int k = 0; k < HC_N; ++k) mx = fmaxf(mx, lanes[i * HC_N + k]);
    __syncwarp();
    const float e = expf(logit - mx);
    float c = e / lanes_sum(e, lanes, i * HC_N, 1) + eps;
    c = c / (lanes_sum(c, lanes, j, HC_N) + eps);
    for (int it = 1; it < iters; ++it) {
        c = c / (lanes_sum(c, lanes, i * HC_N, 1) + eps);
        c = c / (lanes_sum(c, lanes, j, HC_N) + eps);
    }
    if (lane < NN) comb[lane] = c;
}

// hyper_connection: grid (S = ceil(N·D / HC_CHUNK), T), at most HC_THREADS threads (whole warps, > M).
// streams float32 [T, N, D] (D % 4 == 0); fn bf16 [M, N·D]; base float32 [M]; scale float32 [3]; out: post
// [T, N], comb [T, N, N] float32, collapsed bf16 [T, D] (the block's input). Roofline per token: reads the streams 4·N·D bytes (twice: the collapse's
// second read hits L2), writes 2·D + 4·(N + N²); fn (2·M·N·D bytes, V4-Flash 0.79 MB) once per launch from
// DRAM, from L2 for the other rows. V4-Flash (N 4, D 4096): 64 KB in, 8 KB out per token.
extern "C" __global__ void __launch_bounds__(HC_THREADS)
hc_pre(const float* __restrict__ streams, const bf16_t* __restrict__ fn, const float* __restrict__ base,
       const float* __restrict__ scale, float* partial, int* counter, float* __restrict__ post,
       float* __restrict__ comb, bf16_t* __restrict__ collapsed, int D, int iters, float hc_eps, float norm_eps) {
    pdl_begin();
    __shared__ float sums[HC_MIX + 1], pre[HC_N];
    const int t = blockIdx.y, ND = HC_N * D;
    const float* x = streams + (size_t)t * ND;
    if (!row_sums<HC_MIX>(x, fn, ND, partial, counter, sums)) return;
    if (threadIdx.x < 32)
        hc_weights(sums, row_rstd(sums[HC_MIX], ND, norm_eps), base, scale, iters, hc_eps, pre,
                   post + (size_t)t * HC_N, comb + (size_t)t * HC_N * HC_N);
    __syncthreads();
    collapse(x, pre, D, collapsed + (size_t)t * D);
}

// hyper_head: the final collapse (pre weights only: sigmoid(mix · scale + base) + eps, fn [N, N·D], scale [1]).
// Same grid and roofline as hc_pre, with fn N·N·D·2 bytes and no post / comb.
extern "C" __global__ void __launch_bounds__(HC_THREADS)
hc_head(const float* __restrict__ streams, const bf16_t* __restrict__ fn, const float* __restrict__ base,
        const float* __restrict__ scale, float* partial, int* counter, bf16_t* __restrict__ collapsed, int D,
        float hc_eps, float norm_eps) {
    pdl_begin();
    __shared__ float sums[HC_N + 1], pre[HC_N];
    const int t = blockIdx.y, ND = HC_N * D;
    const float* x = streams + (size_t)t * ND;
    if (!row_sums<HC_N>(x, fn, ND, partial, counter, sums)) return;
    const float rstd = row_rstd(sums[HC_N], ND, norm_eps);
    if (threadIdx.x < HC_N)
        pre[threadIdx.x] = sigmoid(sums[threadIdx.x] * rstd * scale[0] + base[threadIdx.x]) + hc_eps;
    __syncthreads();
    collapse(x, pre, D, collapsed + (size_t)t * D);
}

// hc_merge: out[t, n, d] = post[t, n] · block_out[t, d] + sum_j comb[t, j, n] · streams[t, j, d] (comb applied
// transposed), float32. Grid ceil(T·D / (4·HC_POST_THREADS)), four values of every stream of a token a thread.
// Roofline per token: reads 4·N·D + (2 or 4)·D bytes, writes 4·N·D (V4-Flash, bf16 block output: 136 KB).
template <typename B>
__device__ __forceinline__ void hc_post(const B* __restrict__ block_out, const float* __restrict__ streams,
                                        const float* __restrict__ post, const float* __restrict__ comb,
                                        float* __restrict__ out, int T, int D) {
    pdl_begin();
    const int q = blockIdx.x * HC_POST_THREADS + threadIdx.x, t = q / (D / 4), d = 4 * (q % (D / 4));
    if (t >= T) return;
    const float* x = streams + (size_t)t * HC_N * D + d;
    const float* c = comb + (size_t)t * HC_N * HC_N;
    float4 v[HC_N];
    #pragma unroll
    for (int j = 0; j < HC_N; ++j) v[j] = load4(x + (size_t)j * D);
    const float4 b = load4(block_out + (size_t)t * D + d);
    #pragma unroll
    for (int n = 0; n < HC_N; ++n) {
        const float p = post[t * HC_N + n];
        float4 m = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int j = 0; j < HC_N; ++j) {
            const float w = c[j * HC_N + n];
            m.x += w * v[j].x, m.y += w * v[j].y, m.z += w * v[j].z, m.w += w * v[j].w;
        }
        *reinterpret_cast<float4*>(out + ((size_t)t * HC_N + n) * D + d) =
            float4{p * b.x + m.x, p * b.y + m.y, p * b.z + m.z, p * b.w + m.w};
    }
}

extern "C" __global__ void __launch_bounds__(HC_POST_THREADS)
hc_post_f32(const float* __restrict__ block_out, const float* __restrict__ streams, const float* __restrict__ post,
            const float* __restrict__ comb, float* __restrict__ out, int T, int D) {
    hc_post(block_out, streams, post, comb, out, T, D);
}

extern "C" __global__ void __launch_bounds__(HC_POST_THREADS)
hc_post_bf16(const bf16_t* __restrict__ block_out, const float* __restrict__ streams, const float* __restrict__ post,
             const float* __restrict__ comb, float* __restrict__ out, int T, int D) {
    hc_post(block_out, streams, post, comb, out, T, D);
}
