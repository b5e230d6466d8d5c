// Online softmax over one chunk of attention scores (flash attention's running max and sum), shared by
// paged_attention.cu and mla_decode.cu. One warp per query head g < G: the chunk's scores p[g·chunk + j]
// (j < n) become exp(score − m_new), m[g] and l[g] take the chunk in, and alpha[g] = exp(m_old − m_new)
// is the factor the head's accumulators are rescaled by (0 on the first chunk, where m_old = −inf).
// Every thread of the block calls it; the caller syncs before and after.
#pragma once
#include "common.cuh"

__device__ __forceinline__ void online_softmax_chunk(float* p, float* m, float* l, float* alpha, int G, int n,
                                                     int chunk, int nwarps) {
    const int lane = threadIdx.x & 31;
    for (int g = threadIdx.x >> 5; g < G; g += nwarps) {
        float cmax = -INFINITY;
        for (int j = lane; j < n; j += 32) cmax = fmaxf(cmax, p[g * chunk + j]);
        cmax = warp_max(cmax);
        const float m_old = m[g], m_new = fmaxf(m_old, cmax);
        float sum = 0.f;
        for (int j = lane; j < n; j += 32) {
            const float e = expf(p[g * chunk + j] - m_new);
            p[g * chunk + j] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            const float a = expf(m_old - m_new);
            l[g] = l[g] * a + sum;
            m[g] = m_new;
            alpha[g] = a;
        }
    }
}
