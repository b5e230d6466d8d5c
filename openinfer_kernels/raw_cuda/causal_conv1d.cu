// Depthwise causal conv1d + SiLU of a Gated DeltaNet layer over each sequence's conv window, and the
// window's update (prefill, chunked prefill and decode alike). Token t of sequence s (rows cu[s] ..
// cu[s+1] of the step), channel c < C:
//   out[t, c] = bf16(silu(bf16(sum_{j<K} w[c, j] · x_{t-K+1+j}[c])))
// where x_u[c] = proj[u, c] (row stride proj_stride: the q k v columns of the input projection) for
// the step's tokens and, before them, the sequence's conv state (its previous K - 1 inputs, oldest
// first; zeros when the step starts at position 0). Then state[slot] = the last K - 1 inputs. Rounds
// like the bf16 reference (F.conv1d accumulates in float32 and rounds once, SiLU rounds once).
// state: bf16 [slots, K - 1, C] (this layer's); w: bf16 [C, K]; slots[s] < 0: padding, skipped.
// Speculative decoding (held[s], held_drafts.cuh's code: draft rows, accepted held drafts): the window first
// takes the previous step's accepted drafts from held_x ([slots][held_k][C], this layer's), the state is the
// window after the own rows, and the draft rows' inputs go to held_x (a thread owns its channel: read before
// written). Rows past the sequence's last of position >= 0 (a padded step's) are skipped.
// Grid (ceil(C / 256), B), 256 threads: one thread per (channel, sequence) walks the sequence's tokens
// in order with the window in registers (K is the compile-time CONV_K), so the state update needs no
// second pass. Roofline: reads T·C·2 + writes T·C·2 bytes, plus 2·(K-1)·C·2 of state per sequence:
// Qwen3.5-4B (C 8192) decode is 65 KB per sequence per layer (~15 ns at 4.3 TB/s: launch-bound);
// prefill is bandwidth-bound across channels, each thread's loads independent of its FMAs.
#include "common.cuh"
#include "held_drafts.cuh"

#ifndef CONV_K
#define CONV_K 4
#endif

extern "C" __global__ void causal_conv1d(const bf16_t* __restrict__ proj, int proj_stride,
                                         const bf16_t* __restrict__ w, bf16_t* __restrict__ state,
                                         bf16_t* __restrict__ out, const int* __restrict__ cu_seqlens,
                                         const int* __restrict__ positions, const int* __restrict__ slots, int C,
                                         const int* __restrict__ held, bf16_t* __restrict__ held_x, int held_k) {
    pdl_begin();
    const int s = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int slot = slots[s];
    if (c >= C || slot < 0) return;
    const SeqSpan q = seq_span(cu_seqlens, positions, held, s);
    const int t0 = q.t0, end = q.end, own_end = q.own_end, settle = q.settle;
    if (end <= t0) return;
    const bool fresh = positions[t0] == 0;
    bf16_t* st = state + (size_t)slot * (CONV_K - 1) * C + c;
    bf16_t* hx = held_x + (size_t)slot * held_k * C + c;   // only touched with drafts or settle > 0
    float wk[CONV_K], win[CONV_K];                       // win[0 .. K-2]: the previous inputs, oldest first
    #pragma unroll
    for (int j = 0; j < CONV_K; ++j) wk[j] = bf16_to_f(w[(size_t)c * CONV_K + j]);
    #pragma unroll
    for (int j = 0; j < CONV_K - 1; ++j) win[j] = fresh ? 0.f : bf16_to_f(st[(size_t)j * C]);
    for (int j = 0; j < (fresh ? 0 : settle); ++j) {     // the previous step's accepted drafts
        #pragma unroll
        for (int i = 0; i < CONV_K - 2; ++i) win[i] = win[i + 1];
        win[CONV_K - 2] = bf16_to_f(hx[(size_t)j * C]);
    }
    #pragma unroll 4
    for (int t = t0; t < end; ++t) {
        if (t == own_end) {                               // the window after the own rows is the state
            #pragma unroll
            for (int j = 0; j < CONV_K - 1; ++j) st[(size_t)j * C] = f_to_bf16(win[j]);
        }
        const bf16_t in = proj[(size_t)t * proj_stride + c];
        if (t >= own_end) hx[(size_t)(t - own_end) * C] = in;
        win[CONV_K - 1] = bf16_to_f(in);
        float acc = 0.f;
        #pragma unroll
        for (int j = 0; j < CONV_K; ++j) acc += wk[j] * win[j];
        const float a = round_bf16(acc);
        out[(size_t)t * C + c] = f_to_bf16(a / (1.f + __expf(-a)));
        #pragma unroll
        for (int j = 0; j < CONV_K - 1; ++j) win[j] = win[j + 1];
    }
    if (own_end == end) {
        #pragma unroll
        for (int j = 0; j < CONV_K - 1; ++j) st[(size_t)j * C] = f_to_bf16(win[j]);
    }
}
