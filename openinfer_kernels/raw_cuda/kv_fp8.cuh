// The KV cache's element (memory/kv_format.py): bf16, or e4m3 bytes stored as e4m3(x / scale) saturated to
// ±448 (fp8.cuh's e4m3x2) and read as e4m3 · scale, one per-tensor scale per layer and plane passed as a kernel
// argument (k_scale, v_scale). The kernels that touch the cache take the format as a template parameter (FP8)
// and have an `_fp8` entry beside the bf16 one: 8 values move in 8 bytes (a uint2) where bf16 moves them in 16
// (a uint4), and are widened in registers after the load.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)    // device code (tests/cuda_emulation.h: the host's)
// Two e4m3 bytes (lo in the low byte) as floats, exact (e4m3x2 -> f16x2, then each half to f32).
__device__ __forceinline__ void e4m3x2_to_floats(unsigned short v, float& lo, float& hi) {
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(h2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(h2 >> 16)));
}
// 8 bytes global -> shared without registers (cp.async through L1: .cg takes 16 only); zeros when !valid.
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(dst), "l"(gmem), "r"(valid ? 8 : 0)
                 : "memory");
}
#endif

// 8 e4m3 values (a uint2, value i in byte i) as floats times scale.
__device__ __forceinline__ void e4m3x8_to_float(const uint2 v, float scale, float f[8]) {
    const unsigned w[2] = {v.x, v.y};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        float lo, hi;
        e4m3x2_to_floats((unsigned short)(w[i / 2] >> (16 * (i % 2))), lo, hi);
        f[2 * i] = lo * scale;
        f[2 * i + 1] = hi * scale;
    }
}

// 8 bf16 values (a uint4) as e4m3 bytes of x / scale, saturated (the cache write).
__device__ __forceinline__ uint2 bf16x8_to_e4m3x8(const uint4 v, float scale) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    unsigned short p[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = e4m3x2(__uint_as_float(w[i] << 16) / scale, __uint_as_float(w[i] & 0xffff0000u) / scale);
    return make_uint2(p[0] | (unsigned)p[1] << 16, p[2] | (unsigned)p[3] << 16);
}

// 8 e4m3 values (a uint2) as 8 bf16 (a uint4) of e4m3 · scale, rounded once (the CuTe prefill's staging).
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(const uint2 v, float scale) {
    float f[8];
    e4m3x8_to_float(v, scale, f);
    unsigned w[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = (unsigned)f_to_bf16(f[2 * i]) | (unsigned)f_to_bf16(f[2 * i + 1]) << 16;
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 bf16 values (a uint4) into a bf16 or e4m3 cache at element `index` (e4m3: x / scale).
template <bool FP8>
__device__ __forceinline__ void store_kv8(void* cache, size_t index, const uint4 v, float scale) {
    if constexpr (FP8) *reinterpret_cast<uint2*>(static_cast<unsigned char*>(cache) + index) = bf16x8_to_e4m3x8(v, scale);
    else *reinterpret_cast<uint4*>(static_cast<bf16_t*>(cache) + index) = v;
}

// The cache's element type of a format.
template <bool FP8> struct KVElem { typedef bf16_t type; };
template <> struct KVElem<true> { typedef unsigned char type; };
