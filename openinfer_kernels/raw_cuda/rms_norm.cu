// Fused residual add + RMSNorm, rounding like the bf16 reference:
//   r = bf16(x + residual)            (or r = x when there is no residual)
//   out = bf16(w * bf16(r / sqrt(mean(r²) + eps)))
// Roofline: reads x, residual, w and writes r, out: ~4·T·H·2 bytes; T=1, H=2560 is 20 KB (~5 ns of
// bandwidth, so launch-bound at decode); one block per row, 16-byte vectors, fp32 accumulation.
#include "common.cuh"

// out = rmsnorm8 of a row of r with weights w (the second pass of both kernels below).
__device__ __forceinline__ void write_normed_row(const bf16_t* r, const bf16_t* __restrict__ w, bf16_t* out,
                                                 int nvec, float rstd) {
    for (int i = threadIdx.x; i < nvec; i += blockDim.x)
        reinterpret_cast<uint4*>(out)[i] =
            rmsnorm8(reinterpret_cast<const uint4*>(r)[i], reinterpret_cast<const uint4*>(w)[i], rstd);
}

extern "C" __global__ void rms_norm_residual(const bf16_t* __restrict__ x, const bf16_t* __restrict__ residual,
                                             const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                                             bf16_t* __restrict__ resid_out, int hidden, float eps) {
    pdl_begin();
    __shared__ float scratch[33];
    const size_t row = (size_t)blockIdx.x * hidden;
    const int nvec = hidden / 8;
    const float ss = residual_row_sum_squares(x + row, residual != nullptr ? residual + row : nullptr, resid_out + row,
                                              nvec);
    const float rstd = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    write_normed_row((residual != nullptr ? resid_out : x) + row, w, out + row, nvec, rstd);
}

// A split-K product's reduction, its residual add and the RMSNorm after it, in one kernel (decode:
// o_proj / down_proj on the CuTe GEMM's split plans, then the next layer norm):
//   r = bf16(sum_s partial[s] + residual)     (the sum in split order, as openinfer_kernels/cute/splitk_reduce)
//   out = bf16(w * bf16(r / sqrt(mean(r²) + eps))), resid_out = r (may be residual itself)
// partial: `splits` float32 slices of T·hidden, `slice` elements apart. Bit-identical to the split-K
// reduction followed by rms_norm_residual on r. One block per row, one thread per 8 columns (launch
// hidden / 8 threads, rounded up to a warp): each thread's loads of SPLIT_BATCH splits go out together
// (the adds stay in split order). Roofline: 4·S·T·H + 3·2·T·H bytes (T = 8, H = 2560, S = 4: 0.45 MB,
// ~0.1 µs), so launch- and latency-bound like the two kernels it replaces, one launch fewer.
#define SPLIT_BATCH 4
#define LORA_MAX_R 256     // splitk_rms_norm_residual_lora: the most (padded) LoRA ranks
#ifndef LORA_R
#define LORA_R 16          // splitk_rms_norm_residual_lora: the (padded) rank, compiled per executor
#endif
#define LORA_BATCH 8       // 16-byte pieces of a B row loaded together
#define LORA_THREADS 1024  // splitk_rms_norm_residual_lora's threads (the delta phase spreads over them)
#define LORA_MAX_HIDDEN 8192   // its shared delta row (32 KB)

// d = sum_r h[r] · b[r] over one column's B row (LORA_R ranks, contiguous), in rank order; the row's
// pieces go out LORA_BATCH at a time.
__device__ __forceinline__ float lora_column(const bf16_t* __restrict__ b, const float* h) {
    constexpr int Q = LORA_R / 8;
    const uint4* bp = reinterpret_cast<const uint4*>(b);
    float d = 0.f;
    #pragma unroll 1
    for (int q0 = 0; q0 < Q; q0 += LORA_BATCH) {
        uint4 bv[LORA_BATCH];
        #pragma unroll
        for (int u = 0; u < LORA_BATCH; ++u) if (q0 + u < Q) bv[u] = __ldg(bp + q0 + u);
        #pragma unroll
        for (int u = 0; u < LORA_BATCH; ++u) {
            if (q0 + u < Q) {
                const bf16_t* bs = reinterpret_cast<const bf16_t*>(&bv[u]);
                #pragma unroll
                for (int e = 0; e < 8; ++e) d += h[(q0 + u) * 8 + e] * bf16_to_f(bs[e]);
            }
        }
    }
    return d;
}

// acc = sum over the splits of the 8 partial columns of vector i (split order, SPLIT_BATCH loads at a time).
__device__ __forceinline__ void sum_partials8(const float* __restrict__ partial, int splits, long long slice,
                                              size_t prow, int i, float (&acc)[8]) {
    #pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int s0 = 0; s0 < splits; s0 += SPLIT_BATCH) {
        float4 part[SPLIT_BATCH][2];
        #pragma unroll
        for (int j = 0; j < SPLIT_BATCH; ++j) {
            if (s0 + j < splits) {
                const float4* p = reinterpret_cast<const float4*>(partial + (s0 + j) * slice + prow) + 2 * i;
                part[j][0] = p[0];
                part[j][1] = p[1];
            }
        }
        #pragma unroll
        for (int j = 0; j < SPLIT_BATCH; ++j) {
            if (s0 + j < splits) {
                acc[0] += part[j][0].x; acc[1] += part[j][0].y; acc[2] += part[j][0].z; acc[3] += part[j][0].w;
                acc[4] += part[j][1].x; acc[5] += part[j][1].y; acc[6] += part[j][1].z; acc[7] += part[j][1].w;
            }
        }
    }
}

// acc += the delta row's vector i (shared memory, two 16-byte loads: a float a load, 8 lanes 32 bytes apart
// hit one bank, 8-way conflicts).
__device__ __forceinline__ void add_delta8(float (&acc)[8], const float* delta, int i) {
    const float4 a = reinterpret_cast<const float4*>(delta)[2 * i], b = reinterpret_cast<const float4*>(delta)[2 * i + 1];
    acc[0] += a.x; acc[1] += a.y; acc[2] += a.z; acc[3] += a.w;
    acc[4] += b.x; acc[5] += b.y; acc[6] += b.z; acc[7] += b.w;
}

// resid_out's vector i = bf16(acc + residual); its squares added to ss (in element order).
__device__ __forceinline__ void add_residual8(const bf16_t* residual, bf16_t* resid_out, size_t row, int i,
                                              const float (&acc)[8], float& ss) {
    uint4 rv = reinterpret_cast<const uint4*>(residual + row)[i];
    bf16_t* rs = reinterpret_cast<bf16_t*>(&rv);
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
        rs[e] = f_to_bf16(acc[e] + bf16_to_f(rs[e]));
        const float f = bf16_to_f(rs[e]);
        ss += f * f;
    }
    reinterpret_cast<uint4*>(resid_out + row)[i] = rv;
}

// One warp's share of a LoRA row's delta (the helper warps of splitk_norm_row): delta[n] = h · B[slot, n, :]
// for the columns n = 32·(warp index) + lane, then a stride of the helper warps; each warp sums h itself
// (lane j: the shrink column j, over the splits in order) into its row of shared memory, which every lane then
// reads as broadcasts (16-byte loads; a shuffle a rank and column before: 64 a lane at rank 16); rank order as
// lora_column. A lane loads the B rows of LORA_GROUP of its columns before it multiplies any (its L2 round
// trips overlap: at Qwen3-4B's hidden 2560 and 22 helper warps, 4 columns a lane, one trip instead of 4).
#define LORA_GROUP (LORA_R <= 8 ? 8 : LORA_R >= 64 ? 1 : 64 / LORA_R)     // 8 uint4 of B in flight a lane
struct LoraBRows { uint4 v[LORA_GROUP][LORA_R / 8]; };   // a lane's B rows of one pass (LORA_GROUP columns)
#define LORA_B_EARLY (LORA_R <= 16)      // the first pass's rows held across the wait (rank 32: 32 registers, spills)

// The B rows of pass `base` (columns base + g·stride + lane): B is a weight, so the first pass's go out before
// the programmatic-launch wait, over the product's tail (LORA_B_EARLY).
__device__ __forceinline__ void lora_b_rows(LoraBRows& b, const bf16_t* __restrict__ b_slot, int base, int stride,
                                            int hidden) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int g = 0; g < LORA_GROUP; ++g) {
        const int n = min(base + g * stride + lane, hidden - 1);
        const uint4* bp = reinterpret_cast<const uint4*>(b_slot + (size_t)n * LORA_R);
        #pragma unroll
        for (int q = 0; q < LORA_R / 8; ++q) b.v[g][q] = __ldg(bp + q);
    }
}

__device__ __forceinline__ void lora_delta_warp(const float* __restrict__ partial, int splits, long long slice,
                                                size_t hrow, const bf16_t* __restrict__ b_slot, int hidden,
                                                int warp, int warps, float* delta, const LoraBRows& first) {
    constexpr int Q = LORA_R / 8;
    const int lane = threadIdx.x & 31, stride = warps * 32;
    float hl = 0.f;
    if (lane < LORA_R) {
        #pragma unroll 4
        for (int sp = 0; sp < splits; ++sp) hl += partial[sp * slice + hrow + lane];
    }
    __shared__ __align__(16) float h_w[32][LORA_R];      // each helper warp's copy of h, read as broadcasts
    if (lane < LORA_R) h_w[warp][lane] = hl;
    __syncwarp();
    const float4* hv = reinterpret_cast<const float4*>(h_w[warp]);
    LoraBRows bv = first;
    for (int base = warp * 32; base < hidden; base += stride * LORA_GROUP) {
        if (!LORA_B_EARLY || base != warp * 32) lora_b_rows(bv, b_slot, base, stride, hidden);
        float hv4[LORA_R / 4][4];                        // h, 16 bytes a load (broadcast: one address a warp)
        #pragma unroll
        for (int k = 0; k < LORA_R / 4; ++k) {
            const float4 f = hv[k];
            hv4[k][0] = f.x; hv4[k][1] = f.y; hv4[k][2] = f.z; hv4[k][3] = f.w;
        }
        #pragma unroll
        for (int g = 0; g < LORA_GROUP; ++g) {
            float d = 0.f;
            #pragma unroll
            for (int q = 0; q < Q; ++q) {
                const bf16_t* bs = reinterpret_cast<const bf16_t*>(&bv.v[g][q]);
                #pragma unroll
                for (int e = 0; e < 8; ++e) d += hv4[2 * q + e / 4][e % 4] * bf16_to_f(bs[e]);
            }
            const int n = base + g * stride + lane;
            if (n < hidden) delta[n] = d;
        }
    }
}

template <bool LORA>
__device__ __forceinline__ void splitk_norm_row(const float* __restrict__ partial, int splits, long long slice,
                                                int ld, const bf16_t* residual, const bf16_t* __restrict__ w,
                                                bf16_t* __restrict__ out, bf16_t* resid_out, int hidden, float eps,
                                                const int* __restrict__ token_slots,
                                                const bf16_t* __restrict__ B, int R) {
    __shared__ float scratch[33];
    __shared__ float h[LORA ? LORA_R : 1];
    __shared__ __align__(16) float delta[LORA ? LORA_MAX_HIDDEN : 4];
    const size_t row = (size_t)blockIdx.x * hidden, prow = (size_t)blockIdx.x * ld;
    const int nvec = hidden / 8;
    // The step's token -> slot map is uploaded before the step (no kernel writes it), B is a weight: the
    // slot's B starts towards L2 before the wait.
    const int slot = LORA ? token_slots[blockIdx.x] : -1;
    const bf16_t* b_slot = LORA && slot >= 0 ? B + (size_t)slot * hidden * LORA_R : nullptr;
    if (LORA && slot >= 0)
        for (int l = threadIdx.x; l < hidden * LORA_R * 2 / 128; l += blockDim.x)
            prefetch_l2(reinterpret_cast<const char*>(b_slot) + (size_t)l * 128);
    const int vec_threads = (nvec + 31) / 32 * 32;
    const bool helpers = LORA && slot >= 0 && LORA_R <= 32 && (int)blockDim.x >= vec_threads + 32;
    const int helper_warp = ((int)threadIdx.x - vec_threads) >> 5, helper_warps = ((int)blockDim.x - vec_threads) >> 5;
    LoraBRows first;
    if (LORA_B_EARLY && helpers && (int)threadIdx.x >= vec_threads)
        lora_b_rows(first, b_slot, helper_warp * 32, helper_warps * 32, hidden);
    // The next kernel may launch now: it waits for this one before it reads what this one writes.
    pdl_launch_dependents();
    pdl_wait();
    float ss = 0.f;
    if (helpers) {
        // Two roles at once: a thread per vector sums its partials while the warps past them compute the
        // delta (a row's 8 columns a thread, as the sum, left a 10-warp CTA issuing 128 dependent FMAs a
        // thread: 12 µs against the base's 4; the delta first, then the sum, left the two serial).
        float acc[8];
        if ((int)threadIdx.x < nvec)
            sum_partials8(partial, splits, slice, prow, threadIdx.x, acc);
        else if ((int)threadIdx.x >= vec_threads)
            lora_delta_warp(partial, splits, slice, prow + hidden + (size_t)slot * LORA_R, b_slot, hidden,
                            helper_warp, helper_warps, delta, first);
        __syncthreads();
        if ((int)threadIdx.x < nvec) {
            add_delta8(acc, delta, threadIdx.x);
            add_residual8(residual, resid_out, row, threadIdx.x, acc, ss);
        }
    } else {
        if (LORA && slot >= 0) {
            // The row's shrink (its slot's columns, summed in split order), then every column's delta, one
            // column per thread at a time, then the sum below.
            for (int j = threadIdx.x; j < LORA_R; j += blockDim.x) {
                float v = 0.f;
                #pragma unroll 4
                for (int sp = 0; sp < splits; ++sp) v += partial[sp * slice + prow + hidden + (size_t)slot * LORA_R + j];
                h[j] = v;
            }
            __syncthreads();
            for (int n = threadIdx.x; n < hidden; n += blockDim.x) delta[n] = lora_column(b_slot + (size_t)n * LORA_R, h);
            __syncthreads();
        }
        for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
            float acc[8];
            sum_partials8(partial, splits, slice, prow, i, acc);
            if (LORA && slot >= 0) add_delta8(acc, delta, i);     // + the adapter's delta
            add_residual8(residual, resid_out, row, i, acc, ss);
        }
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    write_normed_row(resid_out + row, w, out + row, nvec, rstd);
}

extern "C" __global__ void splitk_rms_norm_residual(const float* __restrict__ partial, int splits, long long slice,
                                                    const bf16_t* residual, const bf16_t* __restrict__ w,
                                                    bf16_t* __restrict__ out, bf16_t* resid_out, int hidden,
                                                    float eps) {
    splitk_norm_row<false>(partial, splits, slice, hidden, residual, w, out, resid_out, hidden, eps, nullptr,
                           nullptr, 0);
}

// The same with a LoRA delta (o_proj / down_proj, gpu_lora_ops.py): the product was by the weight extended
// with every slot's A rows, so a partial row holds `ld` = hidden + S·R columns, the shrink of slot s at
// hidden + s·R; row t with token_slots[t] = s >= 0 adds h · B[s]ᵀ (B [S, hidden, R] bf16, lora_alpha / r
// folded in, R % 8 == 0, R <= LORA_MAX_R) to the reduced sum before the residual add. Extra traffic per
// row: its slot's B (hidden · R · 2 bytes, 82 KB on Qwen3-4B at rank 16, from L2 across the rows).
// R must equal LORA_R, the rank the kernel was compiled for (checked by the caller).
extern "C" __global__ void __launch_bounds__(LORA_THREADS) splitk_rms_norm_residual_lora(const float* __restrict__ partial, int splits,
                                                         long long slice, int ld, const bf16_t* residual,
                                                         const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                                                         bf16_t* resid_out, int hidden, float eps,
                                                         const int* __restrict__ token_slots,
                                                         const bf16_t* __restrict__ B, int R) {
    splitk_norm_row<true>(partial, splits, slice, ld, residual, w, out, resid_out, hidden, eps, token_slots, B, R);
}
