// Speculative decoding's held drafts over Gated DeltaNet state (engine/executor/gpu_held_drafts.py held_code), read
// by causal_conv1d.cu and gated_delta_rule.cu: a sequence's span of the step's rows and its held-draft code.
#pragma once
#include "common.cuh"

// held[s] of sequence s (null: all zero):
// bits 0-7 its draft rows (the last of its rows), 8-15 the held drafts of its previous step it accepted (applied to
// the state first, before its own rows), bit 16 which of the two held buffers those are in (its drafts go to the
// other). A sequence's rows end at its last row of position >= 0 (a padded step's rows after it are skipped).
struct SeqSpan {
    int t0, end, own_end, drafts, settle, sel;
};

__device__ __forceinline__ SeqSpan seq_span(const int* __restrict__ cu_seqlens, const int* __restrict__ positions,
                                            const int* __restrict__ held, int s) {
    SeqSpan q;
    q.t0 = cu_seqlens[s];
    q.end = cu_seqlens[s + 1];
    while (q.end > q.t0 && positions[q.end - 1] < 0) --q.end;
    const int code = held ? held[s] : 0;
    q.drafts = code & 0xFF, q.settle = (code >> 8) & 0xFF, q.sel = (code >> 16) & 1;
    q.own_end = q.end - q.drafts;
    return q;
}

// The recurrent entry takes a sequence of at most one own row, or with drafts to run or held ones to apply; the
// chunked entry the others.
__device__ __forceinline__ bool takes_recurrent(const SeqSpan& q) {
    return q.own_end - q.t0 <= 1 || q.drafts > 0 || q.settle > 0;
}
