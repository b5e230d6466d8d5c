// Shared helpers for the raw CUDA kernels: bf16 stored as uint16, converted with cuda_bf16.h.
#pragma once
#include <cuda_bf16.h>

#ifndef INFINITY                 // NVRTC compiles without the host math headers
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned short bf16_t;   // storage type: the raw bits of a bfloat16

// 16 zero bytes: a load whose piece is out of range reads this instead of branching on the data.
__device__ const uint4 kZero16 = {0u, 0u, 0u, 0u};

// Programmatic dependent launch (openinfer_kernels/raw_cuda/launch.py). pdl_wait: block until the previous
// kernel on the stream has completed and its writes are visible; it returns at once when this kernel
// was launched without the PDL attribute. Every kernel calls it before touching memory another kernel
// writes. pdl_launch_dependents: let the next kernel's blocks be scheduled (they stop at their own
// pdl_wait until this kernel has completed).
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// Both, at the top of a kernel that has nothing to do before its inputs are ready.
__device__ __forceinline__ void pdl_begin() { pdl_wait(); pdl_launch_dependents(); }

__device__ __forceinline__ float bf16_to_f(bf16_t v) {
    return __bfloat162float(__ushort_as_bfloat16(v));
}
__device__ __forceinline__ bf16_t f_to_bf16(float v) {      // round to nearest even
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ float round_bf16(float v) { return bf16_to_f(f_to_bf16(v)); }

// RMSNorm of 8 bf16 values with their weights, rounding like the bf16 reference:
// bf16(w · bf16(x · rstd)) (rms_norm.cu, and gemv.cu's fused prologue).
__device__ __forceinline__ uint4 rmsnorm8(uint4 x, uint4 w, float rstd) {
    bf16_t* xs = reinterpret_cast<bf16_t*>(&x);
    const bf16_t* ws = reinterpret_cast<const bf16_t*>(&w);
    #pragma unroll
    for (int e = 0; e < 8; ++e) xs[e] = f_to_bf16(bf16_to_f(ws[e]) * round_bf16(bf16_to_f(xs[e]) * rstd));
    return x;
}

// SwiGLU of one element from the bf16 gate and up values: bf16(bf16(silu(gate)) · up)
// (silu_mul.cu, and gemv.cu's fused epilogue).
// SiLU(gate)·up of bf16 values: the fast division (a reciprocal and a product, as the CuTe GEMM's SiLU·up
// epilogue computes it) never takes the IEEE division's slow path, which garbage rows past M would
__device__ __forceinline__ bf16_t silu_times(float gate, float up) {
    return f_to_bf16(round_bf16(__fdividef(gate, 1.f + __expf(-gate))) * up);
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)    // device code only (tests/cuda_emulation.h compiles kernels that need none of it on the host)
// 16 bytes global -> shared without registers (cp.async, L2 only); zeros when !valid (no read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
#endif

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Ask L2 for the 128-byte line at p (no register waits on it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__                                     // (a hint: nothing in the host emulation of the tests)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#endif
}

// One head's split weights for the CTA that merges a flash-decoding kernel's splits (one warp, `lane` its
// lane): w[s] = e^(m_s - m) / sum_s' e^(m_s' - m) * l_s' over the splits with l_s > 0, 0 for the empty ones;
// part_max (natural-log maxima) and part_sum the head's S splits, read from L2 (other CTAs wrote them).
__device__ __forceinline__ void split_weights(const float* part_max, const float* part_sum, int S, float* w,
                                              int lane) {
    float mx = -INFINITY;
    for (int sp = lane; sp < S; sp += 32)
        if (__ldcg(part_sum + sp) > 0.f) mx = fmaxf(mx, __ldcg(part_max + sp));
    mx = warp_max(mx);
    float den = 0.f;
    for (int sp = lane; sp < S; sp += 32) {
        const float l = __ldcg(part_sum + sp);
        const float f = l > 0.f ? expf(__ldcg(part_max + sp) - mx) : 0.f;
        w[sp] = f;
        den += l * f;
    }
    den = warp_sum(den);
    for (int sp = lane; sp < S; sp += 32) w[sp] = den > 0.f ? w[sp] / den : 0.f;
}

// Exclusive prefix sum of v over the block (whole warps, at most 1024 threads, in thread order); total gets the
// block's sum. warp_sums: shared [32]; the closing barrier lets the next call reuse it.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? warp_sums[lane] : 0;
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        warp_sums[lane] = w;                 // inclusive over warps
    }
    __syncthreads();
    total = warp_sums[warps - 1];
    const int before = x - v + (warp > 0 ? warp_sums[warp - 1] : 0);
    __syncthreads();
    return before;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* [33] */) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? scratch[lane] : 0.f;
    r = warp_sum(r);
    return r;
}

// A row's residual add and its threads' shares of the sum of squares (rms_norm.cu, fp8_quant.cu): r = bf16(x +
// residual) written to resid_out (residual null: r = x, nothing written); returns this thread's sum of r² over
// the row's 8-value vectors threadIdx.x, threadIdx.x + blockDim.x, ... (nvec of them).
__device__ __forceinline__ float residual_row_sum_squares(const bf16_t* x, const bf16_t* residual, bf16_t* resid_out,
                                                          int nvec) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        uint4 xv = reinterpret_cast<const uint4*>(x)[i];
        bf16_t* xs = reinterpret_cast<bf16_t*>(&xv);
        if (residual != nullptr) {
            uint4 rv = reinterpret_cast<const uint4*>(residual)[i];
            const bf16_t* rs = reinterpret_cast<const bf16_t*>(&rv);
            #pragma unroll
            for (int e = 0; e < 8; ++e) xs[e] = f_to_bf16(bf16_to_f(xs[e]) + bf16_to_f(rs[e]));
            reinterpret_cast<uint4*>(resid_out)[i] = xv;
        }
        #pragma unroll
        for (int e = 0; e < 8; ++e) { float f = bf16_to_f(xs[e]); ss += f * f; }
    }
    return ss;
}
