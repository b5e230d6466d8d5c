// Packed bf16 pair arithmetic (two values per 32-bit register, the first in the low half), each result
// rounded once to nearest even: the dequantizing GEMVs build their tensor-core operands with these.
// The host emulation of the tests (tests/cuda_emulation.h) defines them for g++.
#pragma once
#include "common.cuh"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
__device__ __forceinline__ unsigned bf16x2_sub(unsigned a, unsigned b) {       // a - b
    unsigned d;
    asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {       // a · b
    unsigned d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ unsigned bf16x2_fma(unsigned a, unsigned b, unsigned c) {   // a · b + c, fused
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#endif

// Both halves set to one bf16 value.
__device__ __forceinline__ unsigned bf16x2_splat(bf16_t v) { return (unsigned)v * 0x00010001u; }
