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
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, sizeof f); return f; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, sizeof v); return v; }
// cp.async: the copy done at once (the wait is then a no-op); !valid writes zeros, as the hardware does.
inline void cp_async16(void* smem, const void* gmem, bool valid) {
    if (valid) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

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
