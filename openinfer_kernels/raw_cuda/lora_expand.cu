// LoRA expand at one packed projection (vLLM V1's lora_expand over a token -> slot map): with
//   h[t, :] = sum over chunks c < C of src[c · cstride + t · ld + soff + s · sslot + :NR]   (float32 or bf16)
//   d[t, c] = sum_r h[t, slice(c)·R + r] · B[s, c, r]       (the adapter's delta at output column c)
// for every token t of slot s. src is lora_shrink.cu's split-K partials ([C, T, NR] float32: cstride T·NR,
// ld NR, soff = sslot = 0), or the product by the weight extended with every slot's A rows
// (engine/executor/gpu_lora_ops.py: its output [T, N + S·NR] bf16, C 1, ld N + S·NR, soff N, sslot NR).
// One of four epilogues (mode), y's rows ldy apart:
//   0  y[t, c] = bf16(y[t, c] + d[t, c])      y [T, N] bf16, the projection's output, in place;
//   1  y[t, c] += d[t, c]                     y [T, N] fp32: the first of a split-K GEMM's partials, reduced
//                                             (with the residual add and the next norm) by the kernel after;
//   2  act[t, i] = bf16(bf16(silu(bf16(gate + d_gate))) · bf16(up + d_up))   y the gate_up product bf16,
//                                             act [T, N/2]: the MLP's SiLU·up with the delta added first;
//   3  act[t, c] = bf16(y[t, c] + d[t, c])    act [T, N] bf16: the extended product's first N columns with
//                                             the delta, compacted for the ops after it;
// modes 2 and 3 have one more group in grid.z, the tokens without an adapter (order[starts[S] ..
// starts[S + 1])): plain SiLU·up, or a copy.
// B [S, N, R] bf16 (slot s's B of every slice in the projection's output row order, lora_alpha / r folded
// in, zero-padded to R ranks, R % 8 == 0). slice(c): (c >= b1) + (c >= b2) from the slices' row bounds, or
// with `interleaved` (the GPU's gate_up rows, 8 gate rows then the same 8 up rows) (c / 8) % 2.
// Grid (ceil(N / 256) or ceil(N / 2 / 256), ceil(T / TT), S or S + 1), 256 threads, TT · NR floats of
// dynamic shared memory (the tile's h rows): a thread per output column and the TT tokens of its tile;
// its B row's first ranks are loaded before the programmatic-launch wait.
// Roofline: every used slot's B is read once per token tile (Qwen3-4B, rank 16: 0.98 MB per layer and
// slot, 35 MB per decode step and slot, ~8 µs at 4.3 TB/s) and y read and written (4 bytes per token and
// column: 3.9 MB per layer at batch 32); decode is latency-bound. An 8192-token prefill moves ~1 GB of y
// and takes 8 GFLOP (CUDA cores) per layer, ~0.2 ms each way, against ~2.6 ms of base GEMMs per layer.
#include "common.cuh"

#ifndef TT
#define TT 8       // tokens per CTA (lora_shrink.cu's tile); decode steps compile 4: twice the CTAs, half the
#endif             // serial FMAs a thread (a 32-row step's SiLU·up expand: ~150 CTAs of 2.3 warps a scheduler)
#define RPRE 2     // 16-byte pieces of B (8 ranks each) loaded before the wait

__device__ __forceinline__ void b_row(const bf16_t* b, int R, uint4* pre) {
    #pragma unroll
    for (int q = 0; q < RPRE; ++q) pre[q] = q * 8 < R ? *reinterpret_cast<const uint4*>(b + q * 8) : kZero16;
}

// acc[i] += sum over 8 ranks r0 .. of in[i · NR + r] · bv[r - r0], for the tile's tokens.
__device__ __forceinline__ void fma8(const float* in, int NR, int r0, uint4 bv, float* acc) {
    const bf16_t* bs = reinterpret_cast<const bf16_t*>(&bv);
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float w = bf16_to_f(bs[e]);
        #pragma unroll
        for (int i = 0; i < TT; ++i) acc[i] += in[i * NR + r0 + e] * w;   // rows past n: unused
    }
}

// acc[i] = sum_r in[i · NR + r] · b[r] for the tile's tokens, b's first ranks in pre.
__device__ __forceinline__ void delta(const float* in, int NR, const bf16_t* b, int R, const uint4* pre,
                                      float* acc) {
    #pragma unroll
    for (int i = 0; i < TT; ++i) acc[i] = 0.f;
    #pragma unroll
    for (int q = 0; q < RPRE; ++q)
        if (q * 8 < R) fma8(in, NR, q * 8, pre[q], acc);
    for (int r = RPRE * 8; r < R; r += 8) fma8(in, NR, r, *reinterpret_cast<const uint4*>(b + r), acc);
}

extern "C" __global__ void __launch_bounds__(256) lora_expand(
        const void* __restrict__ src, int src_bf16, long long cstride, int ld, int soff, int sslot,
        const bf16_t* __restrict__ B, const int* __restrict__ order, const int* __restrict__ starts, void* y,
        int ldy, bf16_t* __restrict__ act, int N, int R, int NR, int C, int b1, int b2, int interleaved, int mode) {
    extern __shared__ float rows[];          // [TT, NR]: the tile's h rows
    __shared__ int tok[TT];
    const int S = gridDim.z - (mode >= 2);   // slots; modes 2, 3: the last group, tokens without an adapter
    const int s = blockIdx.z;
    const int begin = starts[s] + blockIdx.y * TT;
    const int n = min(starts[s + 1] - begin, TT);
    if (n <= 0) return;
    const bool adapter = s < S;
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int cols = mode == 2 ? N / 2 : N;
    // this thread's output column(s): c (modes 0, 1) or the gate and up columns of act's column (mode 2)
    const int c = mode != 2 ? col : interleaved ? (col >> 3) * 16 + (col & 7) : col;
    const int cu = interleaved ? c + 8 : col + N / 2;
    uint4 pre[RPRE], pre_up[RPRE];
    if (adapter && col < cols) {
        b_row(B + ((size_t)s * N + c) * R, R, pre);
        if (mode == 2) b_row(B + ((size_t)s * N + cu) * R, R, pre_up);
    }
    if (threadIdx.x < TT) tok[threadIdx.x] = order[begin + min((int)threadIdx.x, n - 1)];
    pdl_wait();
    pdl_launch_dependents();
    __syncthreads();
    // The projection's values this thread reads (modes 2, 3) go out before the shrink's round trip.
    float yv[TT], yu[TT];
    if (mode >= 2 && col < cols) {
        const bf16_t* yb = static_cast<const bf16_t*>(y);
        #pragma unroll
        for (int i = 0; i < TT; ++i) {
            const size_t at = (size_t)tok[i] * ldy;          // rows past n: the tile's last token again
            yv[i] = bf16_to_f(yb[at + c]);
            yu[i] = mode == 2 ? bf16_to_f(yb[at + cu]) : 0.f;
        }
    }
    if (adapter) {
        if (C > 1) {
            for (int e = threadIdx.x; e < TT * NR; e += blockDim.x) rows[e] = 0.f;
            __syncthreads();
        }
        for (int e = threadIdx.x; e < C * n * NR; e += blockDim.x) {   // j fastest: coalesced, no conflicts
            const int j = e % NR, i = (e / NR) % n, ch = e / (NR * n);
            const size_t at = (size_t)ch * cstride + (size_t)tok[i] * ld + soff + (size_t)s * sslot + j;
            const float v = src_bf16 ? bf16_to_f(static_cast<const bf16_t*>(src)[at]) : static_cast<const float*>(src)[at];
            if (C == 1) rows[i * NR + j] = v;
            else atomicAdd(&rows[i * NR + j], v);
        }
        __syncthreads();
    }
    if (col >= cols) return;
    float acc[TT], acc_up[TT];
    if (mode == 3) {
        const int slice = interleaved ? (c >> 3) & 1 : (c >= b1) + (c >= b2);
        if (adapter) delta(rows + slice * R, NR, B + ((size_t)s * N + c) * R, R, pre, acc);
        #pragma unroll
        for (int i = 0; i < TT; ++i)
            if (i < n) act[(size_t)tok[i] * N + c] = f_to_bf16(adapter ? yv[i] + acc[i] : yv[i]);
        return;
    }
    if (mode != 2) {
        const int slice = interleaved ? (c >> 3) & 1 : (c >= b1) + (c >= b2);
        delta(rows + slice * R, NR, B + ((size_t)s * N + c) * R, R, pre, acc);
        #pragma unroll
        for (int i = 0; i < TT; ++i) {
            if (i < n) {
                const size_t at = (size_t)tok[i] * ldy + c;
                if (mode == 0) {
                    bf16_t* p = static_cast<bf16_t*>(y) + at;
                    *p = f_to_bf16(bf16_to_f(*p) + acc[i]);
                } else {
                    static_cast<float*>(y)[at] += acc[i];
                }
            }
        }
        return;
    }
    if (adapter) {
        delta(rows, NR, B + ((size_t)s * N + c) * R, R, pre, acc);          // gate: slice 0
        delta(rows + R, NR, B + ((size_t)s * N + cu) * R, R, pre_up, acc_up);   // up: slice 1
    } else {
        #pragma unroll
        for (int i = 0; i < TT; ++i) acc[i] = acc_up[i] = 0.f;
    }
    #pragma unroll
    for (int i = 0; i < TT; ++i) {
        if (i < n) {
            act[(size_t)tok[i] * (N / 2) + col] = adapter ? silu_times(round_bf16(yv[i] + acc[i]), round_bf16(yu[i] + acc_up[i]))
                                                          : silu_times(yv[i], yu[i]);
        }
    }
}
