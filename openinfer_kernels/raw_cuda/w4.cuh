// 4-bit codes to bf16 weights in registers (gemv_w4.cu, w4_dequant.cu), the format chosen at compile time:
//   W4_FP4         e2m1 codes: W = bf16(e2m1(q) · scale); else unsigned int codes: W = bf16((q - zero) · scale)
//   W4_ZERO        a uint8 zero per (row, group); else 8 (the symmetric formats' offset)
//   W4_SCALE_FP16  fp16 scales, split exactly into bf16 hi + lo so that W = fma(q - zero, hi, (q - zero) · lo)
//                  still rounds once; else bf16 scales
// Each weight is its exact product rounded once to bf16: what the load-time dequantization holds on the GPU.
// A 32-bit word holds 8 codes of one row, the code of k offset j in nibble p with j = 2(p % 4) + p / 4
// (openinfer_kernels/quant/w4_layout.py): pairs (j, j + 1) sit in nibbles (p, p + 4), so one mask and OR
// makes a bf16 pair of 128 + q (int) or of e2m1 · 2^-126 (the e2m1 bits shifted to 12-15 first).
#pragma once
#include "common.cuh"
#include "bf16x2.cuh"

#ifndef W4_FP4
#define W4_FP4 0
#endif
#ifndef W4_ZERO
#define W4_ZERO 0
#endif
#ifndef W4_SCALE_FP16
#define W4_SCALE_FP16 0
#endif

// The bf16 pairs of one (row, group): 128 + zero (the int codes' offset), the scale (hi) and, for fp16
// scales, the rest of it (lo = scale - hi, exact in bf16: an fp16 significand has 3 bits past bf16's); for
// e2m1 codes lo = scale · 2^126 when that is a bf16 (scale <= 2, `one`): one multiply then makes the weight.
struct W4Group { unsigned zero, hi, lo; bool one; };

__device__ __forceinline__ float fp16_bits_to_f(unsigned h) {      // exact (no <cuda_fp16.h> under NVRTC)
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    float f;                                                        // one hardware convert, subnormals kept
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#else
    const unsigned e = (h >> 10) & 31, m = h & 1023;
    const float f = e == 0 ? (float)m * 5.9604644775390625e-8f        // subnormal: m · 2^-24
                  : e == 31 ? (m ? __uint_as_float(0x7fc00000u) : INFINITY) : __uint_as_float(((e + 112) << 23) | (m << 13));
    return (h & 0x8000) ? -f : f;
#endif
}

__device__ __forceinline__ W4Group w4_group(unsigned scale_bits, unsigned zero) {
    W4Group q;
    q.zero = bf16x2_splat((bf16_t)(0x4300u | (W4_ZERO ? zero : 8u)));   // bf16 128 + zero (zero < 128)
#if W4_SCALE_FP16
    const float s = fp16_bits_to_f(scale_bits);
    const bf16_t hi = f_to_bf16(s);
    q.hi = bf16x2_splat(hi);
    q.lo = bf16x2_splat(f_to_bf16(s - bf16_to_f(hi)));
    q.one = false;
#else
    q.hi = bf16x2_splat((bf16_t)scale_bits);
    const unsigned e = (scale_bits >> 7) & 0xFFu;                      // a ue8m0 scale 2^(e - 127) (e = 0: 2^-127)
    q.one = W4_FP4 && e <= 128u;
    q.lo = q.one ? bf16x2_splat((bf16_t)((e + 126u) << 7)) : 0u;       // 2^(e - 1) = scale · 2^126
#endif
    return q;
}

// A lane's group of step `step`: (4·step + tq) / (group / 32) by one multiply-high (w4_group_magic; exact
// while the chunk index stays below 2^32 / (group / 32): any K < 2^21).
__device__ __forceinline__ unsigned w4_group_magic(int group) {
    const unsigned chunks = group / 32;
    return chunks == 1 ? 0u : 0xFFFFFFFFu / chunks + 1u;             // ceil(2^32 / chunks), chunks >= 2
}
__device__ __forceinline__ int w4_group_of(int chunk, unsigned magic) {
    return magic == 0u ? chunk : (int)(((unsigned long long)(unsigned)chunk * magic) >> 32);
}

// Whether `pred` holds in every lane of the warp (the host emulation runs each lane alone: its own).
__device__ __forceinline__ bool w4_warp_all(bool pred) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __all_sync(0xFFFFFFFFu, pred);
#else
    return pred;
#endif
}

// (a & mask) | bits in one LOP3 (written as C, the compiler splits it in two: LOP3 takes one immediate).
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned mask, unsigned bits) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
#else
    return (a & mask) | bits;
#endif
}

// The 8 codes of one word to 4 bf16 pairs of weights: pair j = k (2j, 2j + 1) of the word's 8. ONE (e2m1
// codes, every group's `one`): e2m1 · 2^-126 times scale · 2^126 in one rounding-free multiply, else two.
template <bool ONE = false>
__device__ __forceinline__ void w4_dequant(unsigned w, const W4Group& q, unsigned (&p)[4]) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
#if W4_FP4
        const unsigned t = w << (12 - 4 * j);                                  // codes of pair j to bits 12-15, 28-31
        const unsigned v = (t & 0x80008000u) | ((t >> 6) & 0x01C001C0u);      // sign; e1 e0 m to 8-6: e2m1 · 2^-126
        p[j] = ONE ? bf16x2_mul(v, q.lo) : bf16x2_mul(bf16x2_mul(v, 0x7E807E80u), q.hi);   // · 2^126 (exact), · scale
#else
        const unsigned d = bf16x2_sub(and_or(w >> (4 * j), 0x000F000Fu, 0x43004300u), q.zero);   // q - zero, exact
#if W4_SCALE_FP16
        p[j] = bf16x2_fma(d, q.hi, bf16x2_mul(d, q.lo));
#else
        p[j] = bf16x2_mul(d, q.hi);
#endif
#endif
    }
}
