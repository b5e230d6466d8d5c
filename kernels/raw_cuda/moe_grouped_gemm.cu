// Grouped (MoE) GEMM, the fallback of kernels/cute's grouped_gemm (where the CuTe library is not built
// or its shapes do not fit): for every row r of the expert-grouped activations (moe_align.cu),
//   out[r, n] = bf16(sum_k a[r, k] · w[tile_expert[r / tile_m], n, k])     (fp32 accumulation)
// a [M, K], w [E, N, K], out [M, N] bf16; M a multiple of tile_m (64 or 128), K % 8 == 0. CTA tiles
// of 64 x 64 (4 warps, 32 x 32 each, wmma 16x16x16 bf16 tensor-core tiles), k steps of 32 through
// shared memory (wmma wants 32-byte aligned tiles), single-buffered. A 64-row block whose first row is padding (row_token < 0) is all
// padding (groups fill their tiles from the top) and exits. A fixed grid: graph-capturable.
// Roofline: 2·M·N·K flops against (M·K + used tiles·N·K + M·N)·2 bytes. Decode (M = tiles · 64, a few
// real rows per tile) is weight-bandwidth bound: each used tile streams its expert's N·K weights once
// per 64 output columns... i.e. once, at the ~50% of HBM bandwidth a single-buffered loop reaches; the
// CuTe kernel (TMA, multi-stage ring) is the fast path.
#include <mma.h>
#include "common.cuh"

using namespace nvcuda;

#define BM 64
#define BN 64
#define BK 32
#define LDS (BK + 8)          // bf16 row pitch of the staged tiles (a multiple of 8, off the bank stride)
#define LDC (BN + 4)

extern "C" __global__ void __launch_bounds__(128)
moe_grouped_gemm(const bf16_t* __restrict__ a, const bf16_t* __restrict__ w, const int* __restrict__ tile_expert,
                 const int* __restrict__ row_token, bf16_t* __restrict__ out, int M, int N, int K, int tile_m) {
    pdl_begin();
    __shared__ __align__(32) bf16_t As[BM * LDS];
    __shared__ __align__(32) bf16_t Bs[BN * LDS];
    __shared__ __align__(32) float Cs[BM * LDC];
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    if (row_token != nullptr && row_token[m0] < 0) return;
    const bf16_t* wexp = w + (size_t)tile_expert[m0 / tile_m] * N * K;
    const int tid = threadIdx.x, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

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
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
            #pragma unroll
            for (int i = 0; i < 2; ++i)
                wmma::load_matrix_sync(fa[i], reinterpret_cast<const __nv_bfloat16*>(As + (wm * 32 + i * 16) * LDS + kk), LDS);
            #pragma unroll
            for (int j = 0; j < 2; ++j)
                wmma::load_matrix_sync(fb[j], reinterpret_cast<const __nv_bfloat16*>(Bs + (wn * 32 + j * 16) * LDS + kk), LDS);
            #pragma unroll
            for (int i = 0; i < 2; ++i)
                #pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * LDC + wn * 32 + j * 16, acc[i][j], LDC, wmma::mem_row_major);
    __syncthreads();
    for (int i = tid; i < BM * BN; i += 128) {
        const int r = i / BN, c = i % BN;
        if (n0 + c < N) out[(size_t)(m0 + r) * N + n0 + c] = f_to_bf16(Cs[r * LDC + c]);
    }
}
