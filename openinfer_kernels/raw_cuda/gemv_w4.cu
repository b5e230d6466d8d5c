// W4A16 decode GEMV: y[M, N] = x[M, K] · Wᵀ for M <= 16 rows (NT n8 tiles, 1..2), x bf16, W 4-bit codes with a
// scale (and zero) per group of `group` k along each row, dequantized in registers to the bf16 weights
//   int codes (AWQ, GPTQ, compressed-tensors int4):  W = bf16((q - zero) · scale)
//   e2m1 codes (FP4 experts, ue8m0 scales):          W = bf16(e2m1(q) · scale)
// each rounded ONCE from the exact product: the weights the load-time dequantization holds in bf16, so y
// is that product up to float32 accumulation order (mma.m16n8k16, bf16 operands, fp32 accumulators).
// The format is compile-time (w4.cuh's W4_FP4, W4_ZERO, W4_SCALE_FP16: openinfer_kernels/quant/w4_layout.py
// W4Packed.defines).
//
// The layout (w4_layout.pack_w4; N padded to 16 rows, K to 128, scales to whole groups with 0):
//   codes  uint32 [N/16 tiles][K/128 steps][2 halves][32 lanes][4 words]: the 16-byte piece a lane loads.
//          Lane 4g + t, half h holds row 16·tile + g + 8h, k = 128·step + 32t + 8·word + j (w4.cuh's nibble
//          order within a word).
//   scales uint16 [N/16][G][8 g][2 h] (G = K/128·128 / group), zeros uint8 likewise: a lane's two rows of a
//          group in one 4-byte (2-byte) load.
// A lane's 32 k of a row lie in one group (group % 32 == 0, so K % 32 == 0). Each warp step reads 1 KB of
// codes: every load instruction of a warp is 512 contiguous bytes.
// CTA: W4_RT tiles of 16 rows (1: Qwen3-8B's N = 4096 launches 256 CTAs, not 128 on 132 SMs), the 8 warps
// split K W4_KW ways per tile (gemv_cta.cuh sums them). A warp keeps a ring of its next W4_U steps' codes
// and scales, each slot refilled once read, the first ones issued before pdl_wait (launch.py): the stream
// starts under the previous kernel's tail. x is read at its use from L1 (no batch of it in registers), and
// the two mmas of a word accumulate into two chains (half the dependent-mma latency).
// Roofline: N·K/2 code bytes + N·K/group·2 scale bytes (+ N·K/group zeros) + M·K·2 (x) + M·N·2 (y):
// Qwen3-8B qkv (6144 x 4096, group 128) 12.6 + 0.4 (+0.2) MB, 4.4 µs at the H100's 3.0 TB/s copy rate,
// 3.8x fewer bytes than gemv.cu's bf16 weights; gate_up 24576 x 4096: 52.4 MB, 17.4 µs.
// Why it ran at 0.37-0.68 of that (bench/results/quant-kernels.md) while gemv.cu's bf16 reaches 0.79-0.91:
// at 3.0 TB/s an SM takes 1 KB of codes every ~79 cycles, ~310 issue slots of its 4 schedulers, and the
// 4-bit GEMV issued 268 (compressed-tensors), 300 (FP4) and 358 (AWQ) SASS instructions a KB (sm_90a, M <= 8):
// instruction-bound, AWQ the slowest. The dequantization itself is ~4 a bf16 pair (32 pairs a lane a KB);
// the rest was overhead: a runtime integer division for each step's group (~25), x loads with 64-bit
// selects per 16 bytes (~32), `(c & mask) | magic` compiled as two LOP3s (one immediate each: +32), fp16
// scales converted by branchy C (AWQ, ~70), and the e2m1 codes' second multiply (FP4, +32). The x batch in
// registers held it at 94-102 registers (2 CTAs an SM; 128-137 at M > 8: 1), its one dependent chain
// of 16 mmas a KB left a warp latency-bound, and 128 CTAs of 2 tiles left SMs idle at N = 4096.
// Now 189 (compressed-tensors), 227 (FP4, scales <= 2) and 241 (AWQ) a KB at 64-71 registers (3-4 CTAs an
// SM; M > 8 and the grouped entry 75-96): the group index by a multiply-high, a lane's x pointer chosen
// once a step, one LOP3 a pair (and_or), fp16 by cvt.f32.f16, e2m1 · scale in one multiply (w4.cuh).
#include "common.cuh"
#include "mma.cuh"
#include "w4.cuh"
#include "gemv_cta.cuh"

#ifndef W4_RT
#define W4_RT 1                           // 16-row tiles per CTA
#endif
#ifndef W4_U
#define W4_U 2                            // 128-wide k steps in a warp's ring of code loads
#endif
#define W4_WARPS 8
#define W4_KW (W4_WARPS / W4_RT)          // warps per tile, splitting K

__device__ const uint4 kW4ZeroX[4] = {};          // a lane's 32 k of x past K (or of a row past M)

// One k step of a lane: the 32 codes of its two rows (lo: g, hi: g + 8) dequantized with their groups, times
// its 32 k of each x row (xs), the two mmas of a word into the two accumulation chains c and c2.
template <int NT, bool ONE>
__device__ __forceinline__ void w4_step(uint4 lo, uint4 hi, const W4Group& q_lo, const W4Group& q_hi,
                                        const uint4* const (&xs)[NT], float (&c)[NT][4], float (&c2)[NT][4]) {
    const unsigned wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
    #pragma unroll
    for (int w = 0; w < 4; ++w) {
        unsigned pl[4], ph[4];
        w4_dequant<ONE>(wl[w], q_lo, pl);
        w4_dequant<ONE>(wh[w], q_hi, ph);
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            const uint4 xb = __ldg(xs[n] + w);
            mma_16816(c[n], pl[0], ph[0], pl[1], ph[1], xb.x, xb.y);
            mma_16816(c2[n], pl[2], ph[2], pl[3], ph[3], xb.z, xb.w);
        }
    }
}

// One warp's share of one tile: c += x · W_tileᵀ over k steps [s_begin, s_end) (mma slot layout as
// gemv.cu: a lane's 4 consecutive k per mma on its own fragment slots, in A and B alike).
// Codes of step s: wq + ((tile·S + s)·2 + h)·32 + lane; scale pair: scales[(tile·G + grp)·8 + g].
template <int NT>
__device__ __forceinline__ void w4_tile_dots(const bf16_t* __restrict__ x, const uint4* __restrict__ wq,
                                             const unsigned* __restrict__ scales, const unsigned short* __restrict__ zeros,
                                             int M, int K, int group, int tile, int kw, bool wait_first,
                                             float (&c)[NT][4]) {
    constexpr int U = W4_U;
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int S = (K + 127) / 128, G = (S * 128 + group - 1) / group;
    const int per_warp = (S + W4_KW - 1) / W4_KW;
    const int s_begin = kw * per_warp, s_end = min(S, s_begin + per_warp);
    const unsigned magic = w4_group_magic(group);
    const uint4* wt = wq + (size_t)tile * S * 64 + lane;
    const unsigned* st = scales + (size_t)tile * G * 8 + g;
    const unsigned short* zt = zeros + (size_t)tile * G * 8 + g;
    const bf16_t* x_row[NT];
    bool x_ok[NT];
    gemv_x_rows(x + tq * 32, M, K, g, x_row, x_ok);

    uint4 lo[U], hi[U];              // a ring of the next U steps' codes and group scales (zeros)
    unsigned sc[U], zr[U];
    auto load_step = [&](int u, int step) {
        lo[u] = __ldcs(wt + (size_t)step * 64);
        hi[u] = __ldcs(wt + (size_t)step * 64 + 32);
        const int grp = w4_group_of(step * 4 + tq, magic);
        sc[u] = __ldg(st + grp * 8);
        zr[u] = W4_ZERO ? (unsigned)__ldg(zt + grp * 8) : 0u;
    };
    #pragma unroll
    for (int u = 0; u < U; ++u)
        if (s_begin + u < s_end) load_step(u, s_begin + u);
    if (wait_first) {
        pdl_wait();                  // from here on: x, res_in and y are the previous kernels'
        pdl_launch_dependents();
    }
    float c2[NT][4] = {};            // the second mma of each word: two independent accumulation chains
    for (int s0 = s_begin; s0 < s_end; s0 += U) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int step = s0 + u;
            if (step >= s_end) break;
            const bool k_ok = step * 128 + tq * 32 < K;       // K % 32 == 0: a lane's 32 k are all in or all out
            const uint4* xs[NT];
            #pragma unroll
            for (int n = 0; n < NT; ++n)
                xs[n] = x_ok[n] && k_ok ? reinterpret_cast<const uint4*>(x_row[n] + step * 128) : kW4ZeroX;
            const W4Group q_lo = w4_group(sc[u] & 0xFFFFu, zr[u] & 0xFFu), q_hi = w4_group(sc[u] >> 16, zr[u] >> 8);
            if (W4_FP4 && w4_warp_all(q_lo.one && q_hi.one)) w4_step<NT, true>(lo[u], hi[u], q_lo, q_hi, xs, c, c2);
            else w4_step<NT, false>(lo[u], hi[u], q_lo, q_hi, xs, c, c2);                 // (warp-uniform)
            if (step + U < s_end) load_step(u, step + U);   // the slot refills U steps ahead, once read
        }
    }
    #pragma unroll
    for (int n = 0; n < NT; ++n)
        #pragma unroll
        for (int j = 0; j < 4; ++j) c[n][j] += c2[n][j];
}

// Dense entries: (x [M, K], codes, scales, zeros (0 unless W4_ZERO), y, M, N, K, group, res_in, epi);
// grid ceil(N/16 / W4_RT), 256 threads; epi as gemv_cta.cuh's GEMV_EPI_* (res_in: the residual, may be y).
#define W4_DENSE(NT)                                                                                          \
    gemv_dense<NT, W4_RT, W4_KW>([&](int tile, int kw, float (&c)[NT][4]) {                                 \
        w4_tile_dots<NT>(x, wq, scales, zeros, M, K, group, tile, kw, true, c);                               \
    }, y, M, N, res_in, epi)

extern "C" __global__ void __launch_bounds__(W4_WARPS * 32)
gemv_w4_n1(const bf16_t* x, const uint4* wq, const unsigned* scales, const unsigned short* zeros, void* y, int M,
           int N, int K, int group, const bf16_t* res_in, int epi) {
    W4_DENSE(1);
}

extern "C" __global__ void __launch_bounds__(W4_WARPS * 32)
gemv_w4_n2(const bf16_t* x, const uint4* wq, const unsigned* scales, const unsigned short* zeros, void* y, int M,
           int N, int K, int group, const bf16_t* res_in, int epi) {
    W4_DENSE(2);
}

// Grouped (MoE) decode experts on moe_align.cu's expert-grouped rows, as moe_gemv.cu's moe_gemv:
//   out[r, n] = bf16(a[r] · W[tile_expert[r / tile_m]]ᵀ) for every real row r (row_token[r] >= 0)
// codes / scales / zeros: every expert's layout, one after another. Grid (ceil(N/16 / W4_RT), tiles).
extern "C" __global__ void __launch_bounds__(W4_WARPS * 32)
gemv_w4_grouped(const bf16_t* a, const uint4* wq, const unsigned* scales, const unsigned short* zeros,
                const int* __restrict__ tile_expert, const int* __restrict__ row_token, bf16_t* out, int N, int K,
                int group, int tile_m) {
    const int T = (N + 15) / 16, S = (K + 127) / 128, G = (S * 128 + group - 1) / group;
    gemv_grouped<W4_RT, W4_KW>([&](int r0, int rows, int tile, int kw, float (&c)[2][4]) {
        const size_t e = (size_t)tile_expert[blockIdx.y];
        const bf16_t* x = a + (size_t)r0 * K;
        const uint4* wq_e = wq + e * T * S * 64;
        const unsigned* sc_e = scales + e * T * G * 8;
        const unsigned short* zr_e = zeros + (W4_ZERO ? e * T * G * 8 : 0);
        if (rows <= 8)               // the CTA's rows fill one n8 tile (decode: 1 row an expert a token)
            w4_tile_dots<1>(x, wq_e, sc_e, zr_e, rows, K, group, tile, kw, false, reinterpret_cast<float (&)[1][4]>(c));
        else
            w4_tile_dots<2>(x, wq_e, sc_e, zr_e, rows, K, group, tile, kw, false, c);
    }, row_token, tile_m, out, N);
}
