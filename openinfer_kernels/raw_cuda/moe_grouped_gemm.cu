// Grouped (MoE) GEMM, the fallback of openinfer_kernels/cute's grouped_gemm (where the CuTe library is not built
// or its shapes do not fit): for every row r of the expert-grouped activations (moe_align.cu),
//   out[r, n] = bf16(sum_k a[r, k] · w[tile_expert[r / tile_m], n, k])     (fp32 accumulation)
// a [M, K], w [E, N, K], out [M, N] bf16; M a multiple of tile_m (64 or 128), K % 8 == 0. CTA tiles
// of 64 x 64 (4 warps, 32 x 32 each, mma.m16n8k16 bf16 tensor-core tiles), k steps of 32 through
// shared memory, single-buffered. A 64-row block whose first row is padding (row_token < 0) is all
// padding (groups fill their tiles from the top) and exits. A fixed grid: graph-capturable.
// Roofline: 2·M·N·K flops against (M·K + used tiles·N·K + M·N)·2 bytes. Decode (M = tiles · 64, a few
// real rows per tile) is weight-bandwidth bound: each used tile streams its expert's N·K weights once,
// at the ~50% of HBM bandwidth a single-buffered loop reaches; the CuTe kernel (TMA, multi-stage ring)
// is the fast path.
#include "common.cuh"
#include "mma.cuh"

#define BM 64
#define BN 64
#define BK 32
#define LDS (BK + 8)          // bf16 row pitch of the staged tiles: 20 words, fragment reads bank-conflict free

extern "C" __global__ void __launch_bounds__(128)
moe_grouped_gemm(const bf16_t* __restrict__ a, const bf16_t* __restrict__ w, const int* __restrict__ tile_expert,
                 const int* __restrict__ row_token, bf16_t* __restrict__ out, int M, int N, int K, int tile_m) {
    pdl_begin();
    __shared__ __align__(16) bf16_t As[BM * LDS];
    __shared__ __align__(16) bf16_t Bs[BN * LDS];
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    if (row_token != nullptr && row_token[m0] < 0) return;
    const bf16_t* wexp = w + (size_t)tile_expert[m0 / tile_m] * N * K;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;

    float acc[2][4][4] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        // 64 rows x 32 k = 256 16-byte pieces per operand, 2 per thread; pieces past K or N read zeros.
        #pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int piece = tid + 128 * p, row = piece >> 2, kk = (piece & 3) * 8;
            const bool in_k = k0 + kk < K;
            const uint4 av = in_k ? *reinterpret_cast<const uint4*>(a + (size_t)(m0 + row) * K + k0 + kk) : kZero16;
            const uint4 bv = in_k && n0 + row < N
                                 ? *reinterpret_cast<const uint4*>(wexp + (size_t)(n0 + row) * K + k0 + kk) : kZero16;
            *reinterpret_cast<uint4*>(As + row * LDS + kk) = av;
            *reinterpret_cast<uint4*>(Bs + row * LDS + kk) = bv;
        }
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned fa[2][4], fb[4][2];
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                const bf16_t* s = As + (wm + i * 16 + g) * LDS + kk + 2 * t;
                fa[i][0] = *reinterpret_cast<const unsigned*>(s);
                fa[i][1] = *reinterpret_cast<const unsigned*>(s + 8 * LDS);
                fa[i][2] = *reinterpret_cast<const unsigned*>(s + 8);
                fa[i][3] = *reinterpret_cast<const unsigned*>(s + 8 * LDS + 8);
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bf16_t* s = Bs + (wn + j * 8 + g) * LDS + kk + 2 * t;
                fb[j][0] = *reinterpret_cast<const unsigned*>(s);
                fb[j][1] = *reinterpret_cast<const unsigned*>(s + 8);
            }
            #pragma unroll
            for (int i = 0; i < 2; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma_16816(acc[i][j], fa[i][0], fa[i][1], fa[i][2], fa[i][3], fb[j][0], fb[j][1]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {          // rows g and g + 8
                const int r = m0 + wm + i * 16 + g + 8 * h, c = n0 + wn + j * 8 + 2 * t;
                if (c < N) out[(size_t)r * N + c] = f_to_bf16(acc[i][j][2 * h]);
                if (c + 1 < N) out[(size_t)r * N + c + 1] = f_to_bf16(acc[i][j][2 * h + 1]);
            }
}
