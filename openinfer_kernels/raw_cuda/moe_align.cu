// Token -> expert grouping for the grouped (MoE) GEMM, on the device: openinfer_kernels/cute/moe.py's
// group_by_expert without the host. From the router's ids [T, top_k]:
//   counts[e] = assignments to expert e;
//   expert e's group starts at offsets[e] = sum over e' < e of ceil(counts[e'] / tile_m) · tile_m;
//   row_of[t·top_k + j] = the padded row of assignment (t, j) inside its expert's group;
//   row_token[r] = the token whose activations row r multiplies (-1: a padding row);
//   an id outside [0, E) (another rank's expert under expert parallelism, engine/parallel) is dropped:
//   row_of -1, no row;
//   tile_expert[i] = the expert of M-tile i, for every tile of the fixed grid (max_tiles); tiles past
//   the used ones repeat the last used tile's expert (their rows are padding: they read weights that
//   are already in L2 and their outputs are never read).
// One CTA of 1024 threads; E <= 1024. A fixed launch whatever the routing: graph-capturable, no host
// sync. Rows inside an expert's group are in atomic order: each row's product is independent of its
// place, so the results are the same bits whatever the order.
// Roofline: reads T·top_k ids, writes T·top_k + max_tiles·(tile_m + 1) ints (decode batch 32 of
// Qwen3-30B-A3B: 256 ids, 130 tiles of 64 rows: ~35 KB), a few µs of one SM: latency-bound (one
// block-wide scan), like the other per-layer routing kernels; at 8K-token prefill 0.3 MB.
#include "common.cuh"

#define THREADS 1024
#define MAX_EXPERTS 1024

extern "C" __global__ void __launch_bounds__(THREADS)
moe_align(const int* __restrict__ ids, int T, int top_k, int E, int tile_m,
          int max_tiles, int* __restrict__ row_of, int* __restrict__ row_token, int* __restrict__ tile_expert) {
    pdl_begin();
    __shared__ int counts[MAX_EXPERTS], cursor[MAX_EXPERTS];
    __shared__ int warp_sums[32];
    const int n = T * top_k, rows = max_tiles * tile_m;
    for (int e = threadIdx.x; e < E; e += THREADS) counts[e] = 0;
    for (int r = threadIdx.x; r < rows; r += THREADS) row_token[r] = -1;
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += THREADS) {
        const int e = ids[a];
        if ((unsigned)e < (unsigned)E) atomicAdd(&counts[e], 1);
    }
    __syncthreads();
    int used = 0;
    const int tiles = threadIdx.x < E ? (counts[threadIdx.x] + tile_m - 1) / tile_m : 0;
    const int start = block_exclusive_scan(tiles, warp_sums, used);
    if (threadIdx.x < E) {
        cursor[threadIdx.x] = start * tile_m;
        for (int i = start; i < min(start + tiles, max_tiles); ++i) tile_expert[i] = threadIdx.x;
    }
    __syncthreads();
    // Unused tiles take the expert of the last used tile (expert 0 when nothing is routed).
    int last = 0;
    if (used > 0) {
        for (int e = E - 1; e >= 0; --e) if (counts[e] > 0) { last = e; break; }
    }
    for (int i = used + threadIdx.x; i < max_tiles; i += THREADS) tile_expert[i] = last;
    __syncthreads();             // row_token's -1 fill is done before the rows are claimed below
    for (int a = threadIdx.x; a < n; a += THREADS) {
        const int e = ids[a];
        if ((unsigned)e >= (unsigned)E) { row_of[a] = -1; continue; }   // not here: moe_combine skips it
        const int r = atomicAdd(&cursor[e], 1);
        row_token[r] = a / top_k;
        row_of[a] = r;
    }
}
