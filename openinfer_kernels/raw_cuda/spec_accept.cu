// Speculative decoding's acceptance on the device (engine/executor/verify_rows.py defines it): a verify step
// samples 1 + k rows per sequence (row j: the token after the sequence's drafts d_1..d_j); compare[r] is the
// draft row r's token must equal for the next row to count (-1 on a sequence's last row, and where its grammar
// completes at that draft). out[b] = how many of sequence b's leading rows match (its accepted drafts), then
// out[seqs + r] = ids[r] for every row: the step's one read-back holds both (the emitted tokens of b are rows
// row_start[b] .. row_start[b] + out[b]). One thread per sequence: a step has at most a few hundred sequences
// of at most 33 rows each; the work is a few hundred bytes.
#include "common.cuh"

extern "C" __global__ void spec_accept(const int* __restrict__ ids, const int* __restrict__ compare,
                                       const int* __restrict__ row_start, int seqs, int* __restrict__ out) {
    pdl_begin();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= seqs) return;
    const int first = row_start[b], end = row_start[b + 1];
    int r = first;
    while (compare[r] >= 0 && ids[r] == compare[r]) ++r;
    out[b] = r - first;
    for (r = first; r < end; ++r) out[seqs + r] = ids[r];
}
