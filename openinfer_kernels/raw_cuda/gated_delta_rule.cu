// The gated delta rule of a Gated DeltaNet layer over each sequence's float32 recurrent state
// S [Hv, DK, Dv] (state slot `slots[s]`; zeros when the step starts at position 0), in two entries:
//   gated_delta_rule_recurrent  a sequence of one own row (decode), or with draft rows (a verify step) or held
//                               drafts to apply: the one-step recurrence token by token;
//   gated_delta_rule_chunked    the other sequences (prefill): their tokens in chunks of CHUNK, chunk-parallel.
// Speculative decoding: a sequence's draft rows run after its own rows from the state those leave, their outputs
// written, and are held out of the state: their rows (q, k, v and the gate inputs) kept in the layer's held
// buffers; the sequence's next step first applies the ones it accepted (cpu_deltanet_ops.py HeldDrafts).
// Per token t and value head h (key head h / (Hv / Hk)), with x = the conv output [q | k | v]:
//   q = l2norm(q) · DK^-1/2,  k = l2norm(k)             (float32, eps 1e-6 inside the sqrt)
//   beta = bf16(sigmoid(b)),  g = -exp(a_log) · softplus(a + dt_bias)     (b, a: the input projection)
//   S = e^g S;  S += k (beta (v - Sᵀk))ᵀ;  o = Sᵀ q;   out[t, h] = bf16(o)
// as HF's torch_recurrent / torch_chunk_gated_delta_rule compute it from bf16 inputs (float32 inside).
// The chunked form, within a chunk of n tokens with gamma_i = sum_{j<=i} g_j:
//   L = strictly lower (beta_i k_i·k_j e^{gamma_i - gamma_j}),  A = lower (q_i·k_j e^{gamma_i - gamma_j})
//   vnew = (I + L)^-1 (beta v - beta e^gamma (k S))         (forward substitution, row by row)
//   o_i = e^{gamma_i} q_i S + sum_{j<=i} A_ij vnew_j;    S = e^{gamma_n} S + sum_i k_i e^{gamma_n - gamma_i} vnew_iᵀ
// Both split the value dims into blocks of VB columns, one CTA per (column block, value head,
// sequence): a column of S evolves on its own given k, g and beta.
// DK (the key head dim, <= 256) is a compile-time constant (-DDK=...).
//
// Roofline. Decode: the state is read and written once per token: Hv·DK·Dv·8 bytes per sequence per
// layer (Qwen3.5-4B: 4 MiB; 24 layers: 101 MB per sequence per step, 23 µs at 4.3 TB/s), so a decode
// step's state traffic passes the weights' (~8 GB... per step at batch 1: 1.2%; at batch 128: 1.6x
// the weights). Chunked: the state moves once per chunk (1/64 of the decode traffic per token); the
// work is ~2·CHUNK·DK·(CHUNK + 3·VB) FMA per chunk per CTA on CUDA cores (float32 in shared memory,
// CHUNK² DK of it, L and A, repeated by each of the Dv / VB column CTAs): ~1.9 M FMA per 64 tokens,
// compute-bound; tensor-core MMA on the chunk products is the next step.
#include "common.cuh"
#include "held_drafts.cuh"

#ifndef DK
#define DK 128
#endif
#define VB 32                      // value columns per CTA
#define CHUNK 64                   // tokens per chunk (engine/executor/cpu_deltanet_ops.CHUNK)
#define DEC_WARPS 4
#define ROWS ((DK + DEC_WARPS - 1) / DEC_WARPS)
#define CH_THREADS 256
#define KSTR (DK + 2)              // bf16 row stride of the q / k tiles: rows 65 words apart, no bank conflicts

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// g and beta of value head h from its raw gate inputs a and b (the input projection's columns).
__device__ __forceinline__ void gate_from(bf16_t a_raw, bf16_t b_raw, const bf16_t* __restrict__ a_log,
                                          const bf16_t* __restrict__ dt_bias, int h, float& g, float& beta) {
    g = -__expf(bf16_to_f(a_log[h])) * softplus(bf16_to_f(a_raw) + bf16_to_f(dt_bias[h]));
    beta = round_bf16(1.f / (1.f + __expf(-bf16_to_f(b_raw))));
}

// g and beta of token row t, value head h (every thread that asks computes them).
__device__ __forceinline__ void gate_of(const bf16_t* __restrict__ proj, int proj_stride, int b_off, int a_off,
                                        const bf16_t* __restrict__ a_log, const bf16_t* __restrict__ dt_bias,
                                        int t, int h, float& g, float& beta) {
    const bf16_t* row = proj + (size_t)t * proj_stride;
    gate_from(row[a_off + h], row[b_off + h], a_log, dt_bias, h, g, beta);
}

// ---- recurrent: token by token, grid (ceil(Dv / VB), Hv, B), 128 threads. Thread (warp w, lane l) holds
// S[k][v] for k = w, w + 4, ... and v = blockIdx.x · VB + l in registers for the sequence's whole span.
struct RecurrentSmem {
    float qs[DK], ks[DK], red[DEC_WARPS][VB], scratch[33];
};

// One token of the recurrence on the registers' column s: q, k of key head hk and v from the row xr (the
// conv output [q | k | v]), gate inputs a_raw, b_raw; returns o (in warp 0, for lanes with v < Dv).
__device__ __forceinline__ float delta_token(float (&s)[ROWS], RecurrentSmem& m, const bf16_t* __restrict__ xr,
                                             bf16_t a_raw, bf16_t b_raw, const bf16_t* __restrict__ a_log,
                                             const bf16_t* __restrict__ dt_bias, int key_size, int hk, int h, int Dv,
                                             int v, float scale) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool vok = v < Dv;
    __syncthreads();                                        // the previous token's readers of qs, ks and red are done
    float sq = 0.f, sk = 0.f;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        const float q = bf16_to_f(xr[hk * DK + i]), k = bf16_to_f(xr[key_size + hk * DK + i]);
        m.qs[i] = q; m.ks[i] = k; sq += q * q; sk += k * k;
    }
    const float qinv = rsqrtf(block_sum(sq, m.scratch) + 1e-6f) * scale;
    const float kinv = rsqrtf(block_sum(sk, m.scratch) + 1e-6f);
    float g, beta;
    gate_from(a_raw, b_raw, a_log, dt_bias, h, g, beta);
    const float decay = __expf(g);
    float kv = 0.f;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int k = warp + r * DEC_WARPS;
        s[r] *= decay;
        if (k < DK) kv += s[r] * m.ks[k] * kinv;
    }
    m.red[warp][lane] = kv;
    __syncthreads();
    float kvt = 0.f;
    #pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) kvt += m.red[w][lane];
    const float vin = vok ? bf16_to_f(xr[2 * key_size + h * Dv + v]) : 0.f;
    const float delta = (vin - kvt) * beta;
    float o = 0.f;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int k = warp + r * DEC_WARPS;
        if (k < DK && vok) {
            s[r] += m.ks[k] * kinv * delta;
            o += s[r] * m.qs[k] * qinv;
        }
    }
    __syncthreads();                                        // every warp has read red
    m.red[warp][lane] = o;
    __syncthreads();
    float ot = 0.f;
    #pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) ot += m.red[w][lane];
    return ot;
}

__device__ __forceinline__ void store_state(const float (&s)[ROWS], float* __restrict__ S, int Dv, int v) {
    const int warp = threadIdx.x >> 5;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int k = warp + r * DEC_WARPS;
        if (k < DK && v < Dv) S[(size_t)k * Dv + v] = s[r];
    }
}

// Draft row xr / its gate inputs into held row dst ([x | a (Hv) | b (Hv)]): this CTA's value columns, and the
// key head's q and k from the first column CTA of the key head's first value head, a and b from each head's.
__device__ __forceinline__ void hold_row(bf16_t* __restrict__ dst, const bf16_t* __restrict__ xr, bf16_t a_raw,
                                         bf16_t b_raw, int key_size, int hk, int h, int Hv, int Dv, int v, int rep) {
    const int x_stride = 2 * key_size + Hv * Dv;
    if (threadIdx.x < 32 && v < Dv) dst[2 * key_size + h * Dv + v] = xr[2 * key_size + h * Dv + v];
    if (blockIdx.x != 0) return;
    if (h % rep == 0)
        for (int i = threadIdx.x; i < 2 * DK; i += blockDim.x) {
            const int at = (i < DK ? 0 : key_size) + hk * DK + i % DK;
            dst[at] = xr[at];
        }
    if (threadIdx.x == 0) { dst[x_stride + h] = a_raw; dst[x_stride + Hv + h] = b_raw; }
}

// held_rows: this layer's held drafts, bf16 [slots][2][held_k][x_stride + 2 Hv] (null without speculation).
extern "C" __global__ void gated_delta_rule_recurrent(
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ proj, int proj_stride, int b_off, int a_off,
        const bf16_t* __restrict__ a_log, const bf16_t* __restrict__ dt_bias, float* __restrict__ state,
        bf16_t* __restrict__ out, const int* __restrict__ cu_seqlens, const int* __restrict__ positions,
        const int* __restrict__ slots, int Hk, int Hv, int Dv, float scale, const int* __restrict__ held,
        bf16_t* __restrict__ held_rows, int held_k) {
    pdl_begin();
    const int h = blockIdx.y, seq = blockIdx.z;
    const int slot = slots[seq];
    if (slot < 0) return;                                   // padding sequence: the whole CTA leaves
    const SeqSpan q = seq_span(cu_seqlens, positions, held, seq);
    if (q.end <= q.t0 || !takes_recurrent(q)) return;
    __shared__ RecurrentSmem m;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int key_size = Hk * DK, x_stride = 2 * key_size + Hv * Dv, hw = x_stride + 2 * Hv;
    const int rep = Hv / Hk, hk = h / rep, v = blockIdx.x * VB + lane;
    const bool fresh = positions[q.t0] == 0;
    float* S = state + ((size_t)slot * Hv + h) * DK * Dv;
    float s[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int k = warp + r * DEC_WARPS;
        s[r] = (k < DK && v < Dv && !fresh) ? S[(size_t)k * Dv + v] : 0.f;
    }
    bf16_t* mine = held_rows + (size_t)slot * 2 * held_k * hw;  // only touched with held (drafts or settle > 0)
    for (int j = 0; j < (fresh ? 0 : q.settle); ++j) {     // the previous step's accepted drafts
        const bf16_t* row = mine + ((size_t)q.sel * held_k + j) * hw;
        delta_token(s, m, row, row[x_stride + h], row[x_stride + Hv + h], a_log, dt_bias, key_size, hk, h, Dv, v,
                    scale);
    }
    if (q.own_end <= q.t0) store_state(s, S, Dv, v);
    for (int t = q.t0; t < q.end; ++t) {
        const bf16_t* xr = x + (size_t)t * x_stride;
        const bf16_t* pr = proj + (size_t)t * proj_stride;
        const bf16_t a_raw = pr[a_off + h], b_raw = pr[b_off + h];
        const float o = delta_token(s, m, xr, a_raw, b_raw, a_log, dt_bias, key_size, hk, h, Dv, v, scale);
        if (warp == 0 && v < Dv) out[(size_t)t * Hv * Dv + h * Dv + v] = f_to_bf16(o);
        if (t == q.own_end - 1) store_state(s, S, Dv, v);  // the state after the own rows; drafts are held
        if (t >= q.own_end)
            hold_row(mine + ((size_t)(1 - q.sel) * held_k + (t - q.own_end)) * hw, xr, a_raw, b_raw, key_size, hk,
                     h, Hv, Dv, v, rep);
    }
}

// ---- chunked: grid (ceil(Dv / VB), Hv, B), CH_THREADS threads, chunked_smem_bytes(DK) of dynamic shared
// memory (gpu_deltanet_ops.py). Sequence s is rows cu_seqlens[s] .. cu_seqlens[s + 1] of the step.
struct ChunkSmem {
    bf16_t* qraw; bf16_t* kraw;          // [CHUNK][KSTR]: the chunk's q and k as loaded (bf16)
    float* qinv; float* kinv;            // [CHUNK]: 1 / |q| · scale, 1 / |k|
    float* gam; float* bet; float* kco;  // [CHUNK]: cumulative log decay, beta, e^{gamma_n - gamma_i} / |k_i|
    float* L; float* A;                  // [CHUNK][CHUNK + 1]
    float* R;                            // [CHUNK][VB]: the right-hand side, then vnew
    float* S;                            // [DK][VB]: the state's column block
};

__device__ ChunkSmem carve(char* base) {
    ChunkSmem m;
    m.qraw = reinterpret_cast<bf16_t*>(base); base += CHUNK * KSTR * 2;
    m.kraw = reinterpret_cast<bf16_t*>(base); base += CHUNK * KSTR * 2;
    float* f = reinterpret_cast<float*>(base);
    m.qinv = f; f += CHUNK;
    m.kinv = f; f += CHUNK;
    m.gam = f; f += CHUNK;
    m.bet = f; f += CHUNK;
    m.kco = f; f += CHUNK;
    m.L = f; f += CHUNK * (CHUNK + 1);
    m.A = f; f += CHUNK * (CHUNK + 1);
    m.R = f; f += CHUNK * VB;
    m.S = f;
    return m;
}

// One chunk of n tokens starting at step row t0, for value head h, columns v0 .. v0 + VB.
__device__ void delta_chunk(const ChunkSmem& m, const bf16_t* __restrict__ x, int x_stride, int key_size, int hk,
                            const bf16_t* __restrict__ proj, int proj_stride, int b_off, int a_off,
                            const bf16_t* __restrict__ a_log, const bf16_t* __restrict__ dt_bias,
                            bf16_t* __restrict__ out, int t0, int n, int h, int Hv, int Dv, int v0, float scale) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = CH_THREADS / 32;
    // 1. q and k rows (bf16 pairs), their inverse norms; g and beta
    for (int e = tid; e < CHUNK * (DK / 2); e += CH_THREADS) {
        const int i = e / (DK / 2), kk = 2 * (e % (DK / 2));
        unsigned qv = 0u, kv = 0u;
        if (i < n) {
            const bf16_t* xr = x + (size_t)(t0 + i) * x_stride + hk * DK + kk;
            qv = *reinterpret_cast<const unsigned*>(xr);
            kv = *reinterpret_cast<const unsigned*>(xr + key_size);
        }
        *reinterpret_cast<unsigned*>(m.qraw + i * KSTR + kk) = qv;
        *reinterpret_cast<unsigned*>(m.kraw + i * KSTR + kk) = kv;
    }
    if (tid < CHUNK) {
        float g = 0.f, beta = 0.f;
        if (tid < n) gate_of(proj, proj_stride, b_off, a_off, a_log, dt_bias, t0 + tid, h, g, beta);
        m.gam[tid] = g;
        m.bet[tid] = beta;
    }
    __syncthreads();
    for (int i = warp; i < CHUNK; i += nwarps) {
        float sq = 0.f, sk = 0.f;
        for (int k = lane; k < DK; k += 32) {
            const float q = bf16_to_f(m.qraw[i * KSTR + k]), kf = bf16_to_f(m.kraw[i * KSTR + k]);
            sq += q * q; sk += kf * kf;
        }
        sq = warp_sum(sq); sk = warp_sum(sk);
        if (lane == 0) {
            m.qinv[i] = i < n ? rsqrtf(sq + 1e-6f) * scale : 0.f;
            m.kinv[i] = i < n ? rsqrtf(sk + 1e-6f) : 0.f;
        }
    }
    if (warp == 0) {                                        // inclusive scan of g: two per lane
        const float a = m.gam[2 * lane], b = m.gam[2 * lane + 1];
        float incl = a + b;
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float up = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += up;
        }
        __syncwarp();
        m.gam[2 * lane] = incl - b;
        m.gam[2 * lane + 1] = incl;
    }
    __syncthreads();
    const float gl = m.gam[n - 1];
    if (tid < CHUNK) m.kco[tid] = tid < n ? m.kinv[tid] * __expf(gl - m.gam[tid]) : 0.f;
    // 2. L and A (column-independent), and the right-hand side R = beta (v - e^gamma k S)
    for (int p = tid; p < CHUNK * CHUNK; p += CH_THREADS) {
        const int i = p / CHUNK, j = p % CHUNK;
        float l = 0.f, a = 0.f;
        if (i < n && j <= i) {
            float kk = 0.f, qk = 0.f;
            const bf16_t *ki = m.kraw + i * KSTR, *kj = m.kraw + j * KSTR, *qi = m.qraw + i * KSTR;
            #pragma unroll 8
            for (int k = 0; k < DK; ++k) {
                const float kjf = bf16_to_f(kj[k]);
                kk += bf16_to_f(ki[k]) * kjf;
                qk += bf16_to_f(qi[k]) * kjf;
            }
            const float decay = __expf(m.gam[i] - m.gam[j]);
            a = qk * m.qinv[i] * m.kinv[j] * decay;
            if (j < i) l = m.bet[i] * kk * m.kinv[i] * m.kinv[j] * decay;
        }
        m.L[i * (CHUNK + 1) + j] = l;
        m.A[i * (CHUNK + 1) + j] = a;
    }
    {
        const int i = tid >> 2, c0 = (tid & 3) * 8;         // CH_THREADS = CHUNK x 4 column groups of 8
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (i < n) {
            for (int k = 0; k < DK; ++k) {
                const float kf = bf16_to_f(m.kraw[i * KSTR + k]);
                #pragma unroll
                for (int c = 0; c < 8; ++c) acc[c] += kf * m.S[k * VB + c0 + c];
            }
        }
        const float ek = i < n ? __expf(m.gam[i]) * m.kinv[i] : 0.f;
        const bf16_t* vr = x + (size_t)(t0 + i) * x_stride + 2 * key_size + h * Dv + v0 + c0;
        #pragma unroll
        for (int c = 0; c < 8; ++c) {
            const float vin = (i < n && v0 + c0 + c < Dv) ? bf16_to_f(vr[c]) : 0.f;
            m.R[i * VB + c0 + c] = i < n ? m.bet[i] * (vin - ek * acc[c]) : 0.f;
        }
    }
    __syncthreads();
    // 3. vnew = (I + L)^-1 R, row by row: warp w owns columns 4w .. 4w + 3, 8 lanes per column split the sum
    {
        const int c = warp * 4 + (lane >> 3), p = lane & 7;
        for (int i = 1; i < n; ++i) {
            float s = 0.f;
            for (int j = p; j < i; j += 8) s += m.L[i * (CHUNK + 1) + j] * m.R[j * VB + c];
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            if (p == 0) m.R[i * VB + c] -= s;
            __syncwarp();
        }
    }
    __syncthreads();
    // 4. o = e^gamma q S + A vnew
    {
        const int i = tid >> 2, c0 = (tid & 3) * 8;
        if (i < n) {
            float acc[8], intra[8];
            #pragma unroll
            for (int c = 0; c < 8; ++c) acc[c] = intra[c] = 0.f;
            for (int k = 0; k < DK; ++k) {
                const float qf = bf16_to_f(m.qraw[i * KSTR + k]);
                #pragma unroll
                for (int c = 0; c < 8; ++c) acc[c] += qf * m.S[k * VB + c0 + c];
            }
            for (int j = 0; j <= i; ++j) {
                const float a = m.A[i * (CHUNK + 1) + j];
                #pragma unroll
                for (int c = 0; c < 8; ++c) intra[c] += a * m.R[j * VB + c0 + c];
            }
            const float eq = __expf(m.gam[i]) * m.qinv[i];
            bf16_t* orow = out + (size_t)(t0 + i) * Hv * Dv + h * Dv + v0 + c0;
            #pragma unroll
            for (int c = 0; c < 8; ++c)
                if (v0 + c0 + c < Dv) orow[c] = f_to_bf16(eq * acc[c] + intra[c]);
        }
    }
    __syncthreads();
    // 5. S = e^{gamma_n} S + sum_i k_i e^{gamma_n - gamma_i} vnew_i
    const float chunk_decay = __expf(gl);
    for (int e = tid; e < DK * (VB / 8); e += CH_THREADS) {
        const int k = e / (VB / 8), c0 = (e % (VB / 8)) * 8;
        float acc[8];
        #pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = chunk_decay * m.S[k * VB + c0 + c];
        for (int i = 0; i < n; ++i) {
            const float kf = bf16_to_f(m.kraw[i * KSTR + k]) * m.kco[i];
            #pragma unroll
            for (int c = 0; c < 8; ++c) acc[c] += kf * m.R[i * VB + c0 + c];
        }
        #pragma unroll
        for (int c = 0; c < 8; ++c) m.S[k * VB + c0 + c] = acc[c];
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(CH_THREADS) gated_delta_rule_chunked(
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ proj, int proj_stride, int b_off, int a_off,
        const bf16_t* __restrict__ a_log, const bf16_t* __restrict__ dt_bias, float* __restrict__ state,
        bf16_t* __restrict__ out, const int* __restrict__ cu_seqlens, const int* __restrict__ positions,
        const int* __restrict__ slots, int Hk, int Hv, int Dv, float scale, const int* __restrict__ held) {
    pdl_begin();
    extern __shared__ __align__(16) char smem[];
    const int h = blockIdx.y, s = blockIdx.z, v0 = blockIdx.x * VB;
    const int slot = slots[s];
    if (slot < 0) return;
    const SeqSpan q = seq_span(cu_seqlens, positions, held, s);
    const int t0 = q.t0, t1 = q.end;
    if (t1 <= t0 || takes_recurrent(q)) return;            // the recurrent entry's sequence
    const ChunkSmem m = carve(smem);
    const int key_size = Hk * DK, x_stride = 2 * key_size + Hv * Dv;
    const bool fresh = positions[t0] == 0;
    float* S = state + ((size_t)slot * Hv + h) * DK * Dv;
    for (int e = threadIdx.x; e < DK * VB; e += CH_THREADS) {
        const int k = e / VB, v = v0 + e % VB;
        m.S[e] = (!fresh && v < Dv) ? S[(size_t)k * Dv + v] : 0.f;
    }
    __syncthreads();
    for (int c0 = t0; c0 < t1; c0 += CHUNK)
        delta_chunk(m, x, x_stride, key_size, h / (Hv / Hk), proj, proj_stride, b_off, a_off, a_log, dt_bias, out,
                    c0, min(CHUNK, t1 - c0), h, Hv, Dv, v0, scale);
    for (int e = threadIdx.x; e < DK * VB; e += CH_THREADS) {
        const int k = e / VB, v = v0 + e % VB;
        if (v < Dv) S[(size_t)k * Dv + v] = m.S[e];
    }
}
