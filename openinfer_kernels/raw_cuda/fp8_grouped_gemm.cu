// W8A8 grouped (MoE) GEMM for prefill, on moe_align.cu's expert-grouped rows, as w4_grouped_gemm.cu:
//   out[r, n] = bf16(sum_kb sw(e, n, kb) · sa[kb·ldx + r] · (aq[r, 128kb : 128kb + 128] · wq[e, n, 128kb : ..]))
// for every real row r (row_token[r] >= 0), e = tile_expert[r / tile_m]; aq / sa the grouped rows quantized by
// fp8_quant.cu (e4m3 per token and 128-group, MN-major scales), wq [E, N, K] e4m3 as the checkpoint holds it,
// sw the expert's block scales ws[e][n / 128][kb] (FP8_CHANNEL 0) or one a row ws[e][n] (1, applied after the sum):
// gemv_fp8.cu's product (mma.m16n8k32.e4m3, each 128-block's sum from zero promoted into the float32 total with
// its scales), which re-reads an expert's weights for every 16 of its rows and each row from L2 for every 16
// weight rows. Here a CTA takes 64 token rows x 128 weight rows: the rows' 64 x 128-byte block and their 64
// scales staged in shared memory by cp.async (double-buffered, one block ahead) and read by all 4 warps; each
// warp holds its 32 weight rows' block in registers (two 16-row tiles, the next block's loads in flight) for all
// 64 token rows. Grid (ceil(N / 128), rows / 64), 128 threads; a 64-row block whose first row is padding exits
// (groups fill their tiles from the top), n8 tiles past a block's real rows are skipped, padding rows never
// written. K % 128 == 0; the CTA's 128 weight rows share one block-scale row.
// A lane's B fragment is row 8n + g's 16-byte chunk q = 4·half + tq (gemv_fp8.cu's k order); chunk q of row r
// is stored at q ^ 4·(r & 1), so the 8 lanes of a shared-memory phase (rows g, g + 1) hit 8 bank quads.
// Roofline: 2·rows·N·K flops on mma.sync e4m3 against N·K weight bytes an expert block of 64 rows (L2 after
// the first) and rows·K activation bytes a 128-column slice (L2): DeepSeek-V3's 8,192-token prefill (top-8 of
// 256 experts, gate_up 4096 x 7168) ~3.9 TFLOP a layer's experts.
#include "common.cuh"
#include "mma.cuh"
#include "grouped_gemm.cuh"

#ifndef FP8_CHANNEL
#define FP8_CHANNEL 0
#endif
#define FG_BM 64                          // token rows a CTA (8 n8 tiles of the mma's B operand)
#define FG_WARPS 4                        // each takes 32 weight rows: two 16-row tiles
#define FG_BN (FG_WARPS * 32)             // weight rows a CTA: one 128-row block of the block scales
#define FG_NT (FG_BM / 8)

// The warp's weight rows of one 128-block: [tile][half] rows g (lo) and g + 8 (hi), 16 bytes at 64·half + 16·tq.
struct Fp8Block {
    uint4 lo[2][2], hi[2][2];
};

// c[t][n] += (the block's product of weight tile t and n8 tile n) · sw · sa of each token; xs / ss the staged
// block (this lane's row g of each n8 tile at xs + g·128), `nt` n8 tiles real.
__device__ __forceinline__ void fg_block(const Fp8Block& w, const unsigned char* xs, const float* ss, float sw,
                                         int g, int tq, int nt, float (&c)[2][FG_NT][4]) {
    #pragma unroll
    for (int n = 0; n < FG_NT; ++n) {
        if (n >= nt) break;
        const int r = 8 * n + g;
        uint4 xv[2];
        #pragma unroll
        for (int half = 0; half < 2; ++half)
            xv[half] = *reinterpret_cast<const uint4*>(xs + r * 128 + (((4 * half + tq) ^ (4 * (r & 1))) * 16));
        const float s0 = sw * ss[8 * n + 2 * tq], s1 = sw * ss[8 * n + 2 * tq + 1];
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            float cb[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint4 l = w.lo[t][half], h = w.hi[t][half], x = xv[half];
                mma_16832_e4m3(cb, l.x, h.x, l.y, h.y, x.x, x.y);
                mma_16832_e4m3(cb, l.z, h.z, l.w, h.w, x.z, x.w);
            }
            c[t][n][0] += cb[0] * s0;
            c[t][n][1] += cb[1] * s1;
            c[t][n][2] += cb[2] * s0;
            c[t][n][3] += cb[3] * s1;
        }
    }
}

// Channel scales (one a weight row, after the sum): rows row0 + 16t + g and + 8 of the warp's two tiles.
__device__ __forceinline__ void fg_channel_scales(float (&c)[2][FG_NT][4], const float* __restrict__ sw, int row0,
                                                  int g, int N) {
    #pragma unroll
    for (int t = 0; t < 2; ++t) {
        const float s_lo = __ldg(sw + min(row0 + 16 * t + g, N - 1));
        const float s_hi = __ldg(sw + min(row0 + 16 * t + g + 8, N - 1));
        #pragma unroll
        for (int n = 0; n < FG_NT; ++n)
            #pragma unroll
            for (int j = 0; j < 4; ++j) c[t][n][j] *= j < 2 ? s_lo : s_hi;
    }
}

// aq [rows, K] e4m3, sa [K / 128, ldx] (ldx >= rows, a multiple of 4), wq [E, N, K], ws every expert's scales,
// tile_expert per tile_m rows (tile_m a multiple of 64), out [rows, N] bf16.
extern "C" __global__ void __launch_bounds__(FG_WARPS * 32)
fp8_grouped_gemm(const unsigned char* __restrict__ aq, const float* __restrict__ sa, int ldx,
                 const unsigned char* __restrict__ wq, const float* __restrict__ ws,
                 const int* __restrict__ tile_expert, const int* __restrict__ row_token, bf16_t* __restrict__ out,
                 int N, int K, int tile_m) {
    __shared__ __align__(16) unsigned char smem[GS_BYTES];              // 2 staged blocks, then the epilogue's tile
    unsigned char (*xs)[FG_BM * 128] = reinterpret_cast<unsigned char (*)[FG_BM * 128]>(smem);
    __shared__ __align__(16) float ss[2][FG_BM];
    pdl_begin();
    const int m0 = blockIdx.y * FG_BM;
    const int rows = grouped_block_rows(row_token, m0);
    if (rows == 0) return;
    const int nt = (rows + 7) / 8;
    const size_t e = (size_t)tile_expert[m0 / tile_m];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int KB = K / 128, n0 = blockIdx.x * FG_BN, row0 = n0 + 32 * warp;
    const unsigned char* we = wq + e * N * K;
    const unsigned char* w_row[2][2];                                  // [tile][lo, hi]
    #pragma unroll
    for (int t = 0; t < 2; ++t) {
        w_row[t][0] = we + (size_t)min(row0 + 16 * t + g, N - 1) * K + tq * 16;
        w_row[t][1] = we + (size_t)min(row0 + 16 * t + g + 8, N - 1) * K + tq * 16;
    }
    const float* sw = ws + (FP8_CHANNEL ? e * N : e * ((N + 127) / 128) * KB + (size_t)(n0 / 128) * KB);
    const bool live = row0 < N;                                        // the warp has weight rows

    auto stage = [&](int buf, int b) {              // the rows' block b and its scales; rows past `rows` zero
        #pragma unroll
        for (int p = 0; p < FG_BM * 8 / (FG_WARPS * 32); ++p) {
            const int chunk = threadIdx.x + p * FG_WARPS * 32, r = chunk >> 3, q = chunk & 7;
            const bool ok = r < rows;
            cp_async16(&xs[buf][r * 128 + ((q ^ (4 * (r & 1))) * 16)],
                       ok ? aq + (size_t)(m0 + r) * K + (size_t)b * 128 + q * 16 : aq, ok);
        }
        if (threadIdx.x < FG_BM / 4)                // the 64 scales: m0 + 64 <= ldx, 16-byte aligned
            cp_async16(&ss[buf][4 * threadIdx.x], sa + (size_t)b * ldx + m0 + 4 * threadIdx.x, true);
        cp_async_commit();
    };
    auto load_weights = [&](Fp8Block& w, int b) {
        #pragma unroll
        for (int t = 0; t < 2; ++t)
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                w.lo[t][half] = __ldcs(reinterpret_cast<const uint4*>(w_row[t][0] + (size_t)b * 128 + 64 * half));
                w.hi[t][half] = __ldcs(reinterpret_cast<const uint4*>(w_row[t][1] + (size_t)b * 128 + 64 * half));
            }
    };
    Fp8Block wb[2] = {};                            // [block parity]: the next block's loads in flight
    if (live) {
        load_weights(wb[0], 0);
        if (KB > 1) load_weights(wb[1], 1);
    }
    stage(0, 0);
    float c[2][FG_NT][4] = {};
    staged_steps(KB, stage, [&](int u, int b) {
        if (live) {
            fg_block(wb[u], xs[u], ss[u], FP8_CHANNEL ? 1.f : __ldg(sw + b), g, tq, nt, c);
            if (b + 2 < KB) load_weights(wb[u], b + 2);
        }
    });
    if (FP8_CHANNEL && live) fg_channel_scales(c, sw, row0, g, N);
    grouped_gemm_store(c, reinterpret_cast<bf16_t*>(smem), out, m0, rows, n0, N);
}
