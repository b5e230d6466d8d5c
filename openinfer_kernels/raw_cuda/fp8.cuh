// FP8 e4m3 (the fn variant: ±448 largest, no infinities, S.1111.111 NaN) conversions.
// e4m3x2(lo, hi): two floats to two e4m3 bytes (lo in the low byte), rounded to nearest even and
// saturated to ±448 (cvt.rn.satfinite, sm_89+). The host emulation of the tests defines it for g++.
#pragma once

#define E4M3_MAX 448.f

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));   // a -> upper byte, b -> lower
    return r;
}
#endif
