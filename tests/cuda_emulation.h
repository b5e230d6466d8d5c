// Host emulation of the CUDA thread model, to run raw kernels on a machine without a GPU (tests only):
// compiled with g++ -std=c++20 together with a kernel's source, every CUDA thread of a block is an OS
// thread; __syncthreads and __syncwarp are barriers (a thread that returns drops out of them, as an
// exited GPU thread does), shuffles go through a per-warp exchange, __shared__ variables are statics
// (one block runs at a time), dynamic shared memory is a zeroed buffer. It checks a kernel's indexing,
// synchronization and arithmetic against numpy, not its speed, memory coalescing or occupancy.
#pragma once
#include <cuda_bf16.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct EmuDim { unsigned x = 1, y = 1, z = 1; };
inline thread_local EmuDim threadIdx, blockIdx;
inline EmuDim blockDim, gridDim;
inline std::unique_ptr<std::barrier<>> emu_block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
inline std::vector<float> emu_xchg;                       // [warps][32]
inline std::vector<char> emu_dynamic_smem;
inline std::vector<unsigned> emu_frags;                   // [warps][32][6]: a lane's mma fragments
inline std::vector<const unsigned short*> emu_rows;       // [warps][32]: a lane's ldmatrix row address

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int emu_warp() { return threadIdx.x / 32; }
inline int emu_lane() { return threadIdx.x % 32; }
inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barriers[emu_warp()]->arrive_and_wait(); }

inline float emu_shuffle(float v, int src_lane, bool keep) {
    float* x = emu_xchg.data() + emu_warp() * 32;
    x[emu_lane()] = v;
    __syncwarp();
    const float r = keep ? v : x[src_lane];
    __syncwarp();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) { return emu_shuffle(v, emu_lane() ^ o, false); }
inline float __shfl_up_sync(unsigned, float v, int o) { return emu_shuffle(v, emu_lane() - o, emu_lane() < o); }
inline float __shfl_sync(unsigned, float v, int src) { return emu_shuffle(v, src & 31, false); }
inline int emu_shuffle_int(int v, int src_lane, bool keep) {       // an int's bits through the float exchange
    float f;
    std::memcpy(&f, &v, sizeof f);
    f = emu_shuffle(f, src_lane, keep);
    std::memcpy(&v, &f, sizeof v);
    return v;
}
inline int __shfl_xor_sync(unsigned, int v, int o) { return emu_shuffle_int(v, emu_lane() ^ o, false); }
inline int __shfl_up_sync(unsigned, int v, int o) { return emu_shuffle_int(v, emu_lane() - o, emu_lane() < o); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, sizeof f); return f; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, sizeof v); return v; }
// cp.async: the copy done at once (the wait is then a no-op); !valid writes zeros, as the hardware does.
inline void cp_async16(void* smem, const void* gmem, bool valid) {
    if (valid) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

// Warp-wide tensor-core products (mma.cuh): every lane posts its fragment registers, then computes its four
// accumulators from the whole A and B, products summed in float in k order (the hardware's order and
// rounding inside one instruction may differ). Element e of a lane's register r is A[arow(L, r, e)][acol(..)].
inline float emu_bf16_bits(unsigned v) { return __bfloat162float(__ushort_as_bfloat16((unsigned short)v)); }
inline float emu_e4m3_bits(unsigned v) {                   // e4m3fn: bias 7, no infinities, S.1111.111 NaN
    const int e = (v >> 3) & 15, m = v & 7;
    const float f = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp((float)m, -9) : std::ldexp((float)(8 + m), e - 10);
    return v & 0x80 ? -f : f;
}
template <int K, int PER, typename Decode>
inline void emu_mma(float c[4], const unsigned (&frag)[6], Decode decode) {
    unsigned* mine = emu_frags.data() + (emu_warp() * 32 + emu_lane()) * 6;
    for (int r = 0; r < 6; ++r) mine[r] = frag[r];
    __syncwarp();
    const unsigned* all = emu_frags.data() + emu_warp() * 32 * 6;
    const int bits = 32 / PER, half = K / 2;               // a lane's k span per register: PER values
    float A[16][K], B[K][8];
    for (int L = 0; L < 32; ++L) {
        const int g = L / 4, t = L % 4;
        for (int e = 0; e < PER; ++e) {
            const unsigned mask = (1u << bits) - 1;
            for (int r = 0; r < 4; ++r)                   // a0: (g, lo k), a1: (g+8, lo k), a2: (g, hi k), a3: (g+8, hi k)
                A[g + 8 * (r & 1)][t * PER + e + half * (r >> 1)] = decode((all[L * 6 + r] >> (bits * e)) & mask);
            for (int r = 0; r < 2; ++r) B[t * PER + e + half * r][g] = decode((all[L * 6 + 4 + r] >> (bits * e)) & mask);
        }
    }
    __syncwarp();
    const int g = emu_lane() / 4, t = emu_lane() % 4;
    for (int j = 0; j < 4; ++j) {
        const int row = g + 8 * (j >> 1), col = 2 * t + (j & 1);
        float s = c[j];
        for (int k = 0; k < K; ++k) s += A[row][k] * B[k][col];
        c[j] = s;
    }
}
inline void mma_16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    emu_mma<16, 2>(c, {a0, a1, a2, a3, b0, b1}, emu_bf16_bits);
}
inline void mma_16832_e4m3(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    emu_mma<32, 4>(c, {a0, a1, a2, a3, b0, b1}, emu_e4m3_bits);
}
// ldmatrix.x4.trans (mma.cuh): every lane posts its row address; lane l then takes, of tile i (rows posted by
// lanes 8i .. 8i + 7), elements (2·(l % 4), l / 4) and (2·(l % 4) + 1, l / 4), the first in the low half.
inline void ldmatrix_x4_trans(unsigned r[4], const unsigned short* p) {
    const unsigned short** rows = emu_rows.data() + emu_warp() * 32;
    rows[emu_lane()] = p;
    __syncwarp();
    const int l = emu_lane();
    for (int i = 0; i < 4; ++i)
        r[i] = (unsigned)rows[8 * i + 2 * (l % 4)][l / 4] | (unsigned)rows[8 * i + 2 * (l % 4) + 1][l / 4] << 16;
    __syncwarp();
}

// fp8.cuh: float -> e4m3 rounded to nearest even (ties to the even code), finite values saturated to ±448.
inline unsigned emu_e4m3(float f) {
    const unsigned sign = std::signbit(f) ? 0x80u : 0u;
    const float a = std::fabs(f);
    if (std::isnan(f)) return sign | 0x7Fu;
    unsigned lo = 0;                                       // the largest code whose value is <= a (codes ascend)
    for (unsigned c = 1; c <= 0x7E; ++c) if (emu_e4m3_bits(c) <= a) lo = c;
    if (lo == 0x7E) return sign | 0x7Eu;                   // 448 and beyond
    const float below = emu_e4m3_bits(lo), above = emu_e4m3_bits(lo + 1), mid = (below + above) / 2;   // exact
    const unsigned c = a < mid ? lo : a > mid ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
    return sign | c;
}
inline unsigned short e4m3x2(float lo, float hi) { return (unsigned short)(emu_e4m3(lo) | emu_e4m3(hi) << 8); }
// kv_fp8.cuh: two e4m3 bytes as floats; cp.async of 8 bytes.
inline void e4m3x2_to_floats(unsigned short v, float& lo, float& hi) { lo = emu_e4m3_bits(v & 0xff); hi = emu_e4m3_bits(v >> 8); }
inline void cp_async8(void* smem, const void* gmem, bool valid) {
    if (valid) std::memcpy(smem, gmem, 8); else std::memset(smem, 0, 8);
}

// bf16x2.cuh: packed bf16 pairs, each half computed in float and rounded once (exact for the inputs the
// kernels give it: the float result is exact before that rounding).
template <typename Op>
inline unsigned emu_bf16x2(unsigned a, unsigned b, unsigned c, Op op) {
    unsigned d = 0;
    for (int h = 0; h < 2; ++h) {
        const float v = op(emu_bf16_bits(a >> (16 * h)), emu_bf16_bits(b >> (16 * h)), emu_bf16_bits(c >> (16 * h)));
        d |= (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(v)) << (16 * h);
    }
    return d;
}
inline unsigned bf16x2_sub(unsigned a, unsigned b) { return emu_bf16x2(a, b, 0, [](float x, float y, float) { return x - y; }); }
inline unsigned bf16x2_mul(unsigned a, unsigned b) { return emu_bf16x2(a, b, 0, [](float x, float y, float) { return x * y; }); }
inline unsigned bf16x2_fma(unsigned a, unsigned b, unsigned c) {
    return emu_bf16x2(a, b, c, [](float x, float y, float z) { return std::fma(x, y, z); });
}

// Run body() as every thread of every block of the grid (1-D blocks), blocks one after another.
inline void emu_launch(EmuDim grid, unsigned threads, size_t smem, const std::function<void()>& body) {
    gridDim = grid;
    blockDim = EmuDim{threads, 1, 1};
    const unsigned warps = (threads + 31) / 32;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                emu_block_barrier = std::make_unique<std::barrier<>>(threads);
                emu_warp_barriers.clear();
                for (unsigned w = 0; w < warps; ++w)
                    emu_warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - 32 * w)));
                emu_xchg.assign(warps * 32, 0.f);
                emu_frags.assign(warps * 32 * 6, 0u);
                emu_rows.assign(warps * 32, nullptr);
                emu_dynamic_smem.assign(smem, 0);
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < threads; ++t)
                    pool.emplace_back([=, &body] {
                        threadIdx = EmuDim{t, 0, 0};
                        blockIdx = EmuDim{x, y, z};
                        body();
                        emu_warp_barriers[t / 32]->arrive_and_drop();
                        emu_block_barrier->arrive_and_drop();
                    });
                for (auto& th : pool) th.join();
            }
}
