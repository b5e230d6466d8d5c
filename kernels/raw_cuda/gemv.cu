// Skinny GEMM for decode: y[M, N] = x[M, K] · w[N, K]ᵀ, bf16 in, fp32 accumulate, bf16 or fp32 out,
// for M <= 8·NT (NT n8 tiles, 1..4). One CTA per 16 weight rows, 8 warps splitting K; each lane reads
// 16 bytes of two weight rows (g and g+8, g = lane/4) and of one x row per n8 tile per 32-wide k step,
// and the products run on the tensor cores (mma.m16n8k16, bf16): a dot product does not care in which
// order k is summed, so each lane's 8 consecutive k are mapped onto the fragment slots it owns (A and B
// alike), which keeps every load 16-byte and coalesced (8 x 64-byte row segments per half-warp).
// UNROLL k steps (2·UNROLL weight loads per lane: 8 KB per warp at UNROLL 8, M <= 16; 4 at M <= 32,
// where the x fragments take the registers) are issued before any is used.
// The warps' partial tiles are summed in shared memory. x is read straight from global (it is tiny
// and shared by all CTAs through L2; within a CTA each x element is read once, so staging it in shared
// memory would buy nothing). K must be a multiple of 8 and the rows 16-byte aligned.
// Roofline: N·K·2 weight bytes (+ M·K·2 of x, M·N of y): Qwen3-4B gate_up (19456 x 2560) is 99.6 MB,
// 23 µs at 4.3 TB/s; at M <= 32 the tensor cores have > 20x headroom, so it is purely bandwidth-bound.
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_UNROLL(NT) ((NT) <= 2 ? 8 : 4)

__device__ __forceinline__ void mma_16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ const bf16_t* zero16() { return reinterpret_cast<const bf16_t*>(&kZero16); }

__device__ __forceinline__ uint4 load_streaming(const bf16_t* p) {   // weights: read once, evict first
    return __ldcs(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void store(bf16_t* y, size_t i, float v) { y[i] = f_to_bf16(v); }
__device__ __forceinline__ void store(float* y, size_t i, float v) { y[i] = v; }

template <int NT, typename OutT>
__device__ __forceinline__ void gemv_tile(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                          OutT* __restrict__ y, int M, int N, int K) {
    __shared__ float red[GEMV_WARPS][NT * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int row0 = blockIdx.x * 16;
    const bool lo_ok = row0 + g < N, hi_ok = row0 + g + 8 < N;
    const bf16_t* w_lo = w + (size_t)(lo_ok ? row0 + g : 0) * K;
    const bf16_t* w_hi = w + (size_t)(hi_ok ? row0 + g + 8 : 0) * K;
    const bf16_t* x_row[NT];
    bool x_ok[NT];
    #pragma unroll
    for (int n = 0; n < NT; ++n) {
        x_ok[n] = n * 8 + g < M;
        x_row[n] = x + (size_t)(x_ok[n] ? n * 8 + g : 0) * K;
    }
    const int steps = (K + 31) / 32;
    const int per_warp = (steps + GEMV_WARPS - 1) / GEMV_WARPS;
    const int s_begin = warp * per_warp, s_end = min(steps, s_begin + per_warp);

    float c[NT][4];
    #pragma unroll
    for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
    constexpr int U = GEMV_UNROLL(NT);
    for (int s0 = s_begin; s0 < s_end; s0 += U) {
        uint4 a_lo[U], a_hi[U], b[U][NT];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            // Out-of-range pieces read a zero vector: the select is on the address, never on loaded
            // data, so nothing waits on a load before all of this iteration's loads are issued.
            const int k = (s0 + u) * 32 + tq * 8;
            const bool k_ok = s0 + u < s_end && k < K;
            a_lo[u] = load_streaming(k_ok && lo_ok ? w_lo + k : zero16());
            a_hi[u] = load_streaming(k_ok && hi_ok ? w_hi + k : zero16());
            #pragma unroll
            for (int n = 0; n < NT; ++n)
                b[u][n] = __ldg(reinterpret_cast<const uint4*>(k_ok && x_ok[n] ? x_row[n] + k : zero16()));
        }
        #pragma unroll
        for (int u = 0; u < U; ++u)
            #pragma unroll
            for (int n = 0; n < NT; ++n) {
                // k slots (2tq, 2tq+1 | 2tq+8, 2tq+9) of the first mma <- this lane's k 0..3, the second <- 4..7
                mma_16816(c[n], a_lo[u].x, a_hi[u].x, a_lo[u].y, a_hi[u].y, b[u][n].x, b[u][n].y);
                mma_16816(c[n], a_lo[u].z, a_hi[u].z, a_lo[u].w, a_hi[u].w, b[u][n].z, b[u][n].w);
            }
    }
    #pragma unroll
    for (int n = 0; n < NT; ++n)
        #pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][n * 4 + j][lane] = c[n][j];
    __syncthreads();
    // Thread i < 32·NT·4 sums one accumulator slot over the warps and stores it:
    // c[n][j] of lane (g, tq) is y[m = 8n + 2tq + (j & 1), row = row0 + g + 8·(j >> 1)].
    for (int i = threadIdx.x; i < NT * 4 * 32; i += blockDim.x) {
        const int slot = i / 32, ln = i % 32, n = slot / 4, j = slot % 4;
        const int m = n * 8 + (ln & 3) * 2 + (j & 1), row = row0 + (ln >> 2) + 8 * (j >> 1);
        if (m >= M || row >= N) continue;
        float v = 0.f;
        #pragma unroll
        for (int wp = 0; wp < GEMV_WARPS; ++wp) v += red[wp][slot][ln];
        store(y, (size_t)m * N + row, v);
    }
}

#define GEMV_ENTRY(NT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
    gemv_bf16_n##NT(const bf16_t* x, const bf16_t* w, bf16_t* y, int M, int N, int K) {                 \
        gemv_tile<NT>(x, w, y, M, N, K);                                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
    gemv_f32_n##NT(const bf16_t* x, const bf16_t* w, float* y, int M, int N, int K) {                   \
        gemv_tile<NT>(x, w, y, M, N, K);                                                                \
    }

GEMV_ENTRY(1)
GEMV_ENTRY(2)
GEMV_ENTRY(3)
GEMV_ENTRY(4)
