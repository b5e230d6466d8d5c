// W4A16 grouped (MoE) GEMM for prefill, on moe_align.cu's expert-grouped rows, as moe_grouped_gemm.cu:
//   out[r, n] = bf16(a[r] · W[tile_expert[r / tile_m]]ᵀ) for every real row r (row_token[r] >= 0)
// W the experts' 4-bit codes in gemv_w4.cu's layout (openinfer_kernels/quant/w4_layout.py, the experts one after
// another), dequantized in registers to w4.cuh's bf16 weights (each the exact product rounded once: the weights a
// load-time dequantization holds), mma.m16n8k16 with float32 accumulation. The decode GEMV (gemv_w4_grouped)
// splits K over a CTA's warps for 16 weight rows and re-reads the weights and dequantizes them again for every 16
// token rows; with hundreds of rows an expert (a long prompt) it spent most of a prefill re-reading the
// activations from L2 (each token row once for every 16 weight rows) and dequantizing. Here a CTA takes 64 token
// rows x 128 weight rows: the activations' 64 x 128 k tile of each k step staged in shared memory by cp.async
// (double-buffered, one step ahead) and read by all 4 warps; each warp dequantizes its 32 weight rows (two 16-row
// tiles of the layout, their codes one step ahead in registers) once for all 64 token rows, the mma's A operand
// (weight rows, the layout's fragment order) against B fragments of 8 token rows from shared memory.
// Grid (ceil(N / 128), rows / 64), 128 threads; a 64-row block whose first row is padding exits (groups fill
// their tiles from the top), n8 tiles past a block's real rows are skipped, padding rows never written.
// The staged k order follows the layout's: lane tq's word w holds k 32·tq + 8·w .. + 7 (w4.cuh), so a lane reads
// x's 16-byte chunk q = 4·tq + w of its row; chunk q is stored at q ^ 2·(q >> 3 & 1) and rows are 272 bytes
// apart, so the 8 lanes of one shared-memory phase (rows g, g + 1, tq = 0..3) hit 8 different bank quads.
// Roofline: 2·rows·N·K flops on mma.sync (about 2/3 of Hopper's wgmma peak) against N·K/2 code bytes an expert
// block of 64 rows (L2 after the first) and rows·K·2 activation bytes a 128-column slice (L2): for DeepSeek-V4's
// 8,192-token prefill (top-6 of 256 experts, gate_up 4096 x 4096) ~2.5 TFLOP a layer's experts, ~4 ms at
// 600 TFLOP/s.
#include "common.cuh"
#include "mma.cuh"
#include "w4.cuh"
#include "grouped_gemm.cuh"

#define WG_BM 64                          // token rows a CTA (8 n8 tiles of the mma's B operand)
#define WG_WARPS 4                        // each takes 32 weight rows: two 16-row tiles of the layout
#define WG_BN (WG_WARPS * 32)             // weight rows a CTA
#define WG_NT (WG_BM / 8)
#define WG_PITCH GS_PITCH                 // bf16 a staged row: 128 k + 8

__device__ __forceinline__ int wg_chunk(int q) { return q ^ ((q >> 2) & 2); }    // q ^ 2·(q >> 3 & 1)

__device__ __forceinline__ unsigned wg_word(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// The warp's 2 x 8 accumulator tiles += its two weight tiles' step (codes lo / hi, group pairs q) times the
// staged activations xs (this lane's row g of each n8 tile); `nt` n8 tiles hold real rows.
__device__ __forceinline__ void wg_step(const uint4 (&lo)[2], const uint4 (&hi)[2], const W4Group (&ql)[2],
                                        const W4Group (&qh)[2], const bool (&one)[2], const bf16_t* xs, int tq,
                                        int nt, float (&c)[2][WG_NT][4]) {
    #pragma unroll
    for (int w = 0; w < 4; ++w) {
        unsigned pl[2][4], ph[2][4];
        #pragma unroll
        for (int t = 0; t < 2; ++t) {               // one[t] is warp-uniform (w4_warp_all)
            if (one[t]) {
                w4_dequant<true>(wg_word(lo[t], w), ql[t], pl[t]);
                w4_dequant<true>(wg_word(hi[t], w), qh[t], ph[t]);
            } else {
                w4_dequant<false>(wg_word(lo[t], w), ql[t], pl[t]);
                w4_dequant<false>(wg_word(hi[t], w), qh[t], ph[t]);
            }
        }
        #pragma unroll
        for (int n = 0; n < WG_NT; ++n) {
            if (n >= nt) break;
            const uint4 x = *reinterpret_cast<const uint4*>(xs + n * 8 * WG_PITCH + wg_chunk(4 * tq + w) * 8);
            #pragma unroll
            for (int t = 0; t < 2; ++t) {
                mma_16816(c[t][n], pl[t][0], ph[t][0], pl[t][1], ph[t][1], x.x, x.y);
                mma_16816(c[t][n], pl[t][2], ph[t][2], pl[t][3], ph[t][3], x.z, x.w);
            }
        }
    }
}

// a [rows, K] bf16, codes / scales / zeros (0 unless W4_ZERO) every expert's layout, tile_expert per tile_m rows
// (tile_m a multiple of 64), out [rows, N] bf16.
extern "C" __global__ void __launch_bounds__(WG_WARPS * 32)
w4_grouped_gemm(const bf16_t* __restrict__ a, const uint4* __restrict__ wq, const unsigned* __restrict__ scales,
                const unsigned short* __restrict__ zeros, const int* __restrict__ tile_expert,
                const int* __restrict__ row_token, bf16_t* __restrict__ out, int N, int K, int group, int tile_m) {
    __shared__ __align__(16) bf16_t xs[2][WG_BM * WG_PITCH];
    pdl_begin();
    const int m0 = blockIdx.y * WG_BM;
    const int rows = grouped_block_rows(row_token, m0);
    if (rows == 0) return;
    const int nt = (rows + 7) / 8;
    const size_t e = (size_t)tile_expert[m0 / tile_m];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int T = (N + 15) / 16, S = (K + 127) / 128, G = (S * 128 + group - 1) / group;
    const int tile0 = blockIdx.x * (WG_BN / 16) + 2 * warp;
    const bool has[2] = {tile0 * 16 < N, (tile0 + 1) * 16 < N};
    const unsigned magic = w4_group_magic(group);
    const uint4* wt = wq + (e * T + tile0) * S * 64 + lane;                   // tile0 + 1: + S·64
    const unsigned* st = scales + (e * T + tile0) * G * 8 + g;                 // tile0 + 1: + G·8
    const unsigned short* zt = zeros + (W4_ZERO ? (e * T + tile0) * G * 8 + g : 0);
    const bf16_t* a0 = a + (size_t)m0 * K;

    auto stage = [&](int buf, int s) {              // the 64 x 128 activation tile of step s, rows past `rows` zero
        #pragma unroll
        for (int p = 0; p < WG_BM * 16 / (WG_WARPS * 32); ++p) {
            const int chunk = threadIdx.x + p * WG_WARPS * 32, r = chunk >> 4, q = chunk & 15, k = s * 128 + q * 8;
            const bool ok = r < rows && k < K;       // K % 32 == 0: a chunk is whole or past K
            cp_async16(&xs[buf][r * WG_PITCH + wg_chunk(q) * 8], ok ? a0 + (size_t)r * K + k : a0, ok);
        }
        cp_async_commit();
    };
    uint4 lo[2][2] = {}, hi[2][2] = {};             // [slot: step parity][tile]: codes one step ahead
    unsigned sc[2][2] = {}, zr[2][2] = {};
    auto load_codes = [&](int u, int s) {
        const int grp = w4_group_of(s * 4 + tq, magic);
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            if (!has[t]) continue;
            lo[u][t] = __ldcs(wt + ((size_t)t * S + s) * 64);
            hi[u][t] = __ldcs(wt + ((size_t)t * S + s) * 64 + 32);
            sc[u][t] = __ldg(st + ((size_t)t * G + grp) * 8);
            zr[u][t] = W4_ZERO ? (unsigned)__ldg(zt + ((size_t)t * G + grp) * 8) : 0u;
        }
    };
    load_codes(0, 0);
    if (S > 1) load_codes(1, 1);
    stage(0, 0);
    float c[2][WG_NT][4] = {};
    staged_steps(S, stage, [&](int u, int s) {
        if (has[0]) {
            W4Group ql[2], qh[2];
            bool one[2];
            #pragma unroll
            for (int t = 0; t < 2; ++t) {
                ql[t] = w4_group(sc[u][t] & 0xFFFFu, zr[u][t] & 0xFFu);
                qh[t] = w4_group(sc[u][t] >> 16, zr[u][t] >> 8);
                one[t] = W4_FP4 && w4_warp_all(ql[t].one && qh[t].one);
            }
            wg_step(lo[u], hi[u], ql, qh, one, xs[u] + g * WG_PITCH, tq, nt, c);
        }
        if (s + 2 < S) load_codes(u, s + 2);
    });
    grouped_gemm_store(c, xs[0], out, m0, rows, blockIdx.x * WG_BN, N);
}
