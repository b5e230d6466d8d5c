// DeepSeek-V4's compressor closing its windows (engine/executor/cpu_dsv4_attention.py close_entries /
// compress_windows, transformers' DeepseekV4Compressor): a step token at position p with (p + 1) % rate == 0
// closes the window of positions first = p + 1 - rate .. p, whose entry [d] is, per column c, the softmax over
// the window's slots of gate + ape (the learned position bias) weighting the slots' kv, then RMSNorm over the
// d columns (times norm), then the interleaved rope of its trailing rope_dim columns at position `first`; it is
// stored as bf16 in the closing token's own row at out_col. With overlap (CSA, and every indexer key) each token
// holds two series [kv: a | b, gate: a | b] and the entry's slots are the previous window's series a (none for
// window 0) then its own series b. Other tokens' CTAs return at once: a launch over the step's tokens has fixed
// shapes and no host reads (graph-capturable).
//
// The rows are the layer's bf16 [slots, row_width], a token's compressor kv | gate from column src (s · d each,
// s = 2 with overlap), read through the paged rows as rows_at does (tables [T, max_blocks]: each token's
// sequence's blocks). No CTA writes columns another reads: an entry overwrites its own row's own series (CSA's
// next window reads series a), after its CTA has read them.
//
// Roofline per closing token: reads (1 + overlap) · rate slots · 2 · d bf16 values (CSA's entry of 512: 16 KB;
// HCA's, 128 slots: 256 KB; the indexer's key of 128: 4 KB) and writes 2 · d bytes, once per rate tokens:
// a few µs of one SM per launch at decode, latency-bound like the other per-layer small kernels.
#include "common.cuh"

#define COMP_THREADS 128
#define COMP_MAX_D 1024                 // entry width held in shared memory for the norm and the rope

__device__ __forceinline__ const bf16_t* token_row(const bf16_t* kv, const int* table, int p, int block,
                                                   int row_width) {
    return kv + ((size_t)table[p / block] * block + p % block) * row_width;
}

// Column c's softmax-weighted kv over the window's slots (slot j < rate of the previous window with overlap:
// its series a; then the window's own slots: series b with overlap, the only series without).
__device__ float window_sum(const bf16_t* kv, const int* table, const float* ape, int first, int c, int d,
                            int overlap, int rate, int block, int row_width, int src) {
    const int sd = (1 + overlap) * d, own = overlap ? d : 0, j0 = overlap && first > 0 ? 0 : rate * overlap;
    const int slots = rate * (1 + overlap);
    float mx = -INFINITY;
    for (int j = j0; j < slots; ++j) {
        const bool prev = j < rate * overlap;
        const int jj = prev ? j : j - rate * overlap, at = first + jj - (prev ? rate : 0), col = prev ? c : own + c;
        const float g = bf16_to_f(token_row(kv, table, at, block, row_width)[src + sd + col]) + ape[jj * sd + col];
        mx = fmaxf(mx, g);
    }
    float sum = 0.f, acc = 0.f;
    for (int j = j0; j < slots; ++j) {
        const bool prev = j < rate * overlap;
        const int jj = prev ? j : j - rate * overlap, at = first + jj - (prev ? rate : 0), col = prev ? c : own + c;
        const bf16_t* row = token_row(kv, table, at, block, row_width) + src;
        const float e = expf(bf16_to_f(row[sd + col]) + ape[jj * sd + col] - mx);
        sum += e;
        acc += e * bf16_to_f(row[col]);
    }
    return acc / sum;
}

// compress_close: grid (T), COMP_THREADS threads. kv: the layer's bf16 rows; tables int32 [T, max_blocks];
// positions int32 [T] (-1: padding); ape float32 [rate, s · d]; norm float32 [d]; inv_freq float32
// [rope_dim / 2]; d <= COMP_MAX_D.
extern "C" __global__ void __launch_bounds__(COMP_THREADS)
compress_close(bf16_t* kv, const int* __restrict__ tables, const int* __restrict__ positions,
               const float* __restrict__ ape, const float* __restrict__ norm, const float* __restrict__ inv_freq,
               int max_blocks, int block, int row_width, int src, int d, int overlap, int rate, int rope_dim,
               int out_col, float eps) {
    pdl_begin();
    __shared__ float entry[COMP_MAX_D], scratch[33];
    const int t = blockIdx.x, pos = positions[t];
    if (pos < 0 || (pos + 1) % rate) return;                            // the whole CTA
    const int first = pos + 1 - rate;
    const int* table = tables + (size_t)t * max_blocks;
    float sq = 0.f;
    for (int c = threadIdx.x; c < d; c += COMP_THREADS) {
        const float v = window_sum(kv, table, ape, first, c, d, overlap, rate, block, row_width, src);
        entry[c] = v;
        sq += v * v;
    }
    const float rstd = 1.f / sqrtf(block_sum(sq, scratch) / d + eps);   // its barriers: entry[] complete
    bf16_t* out = const_cast<bf16_t*>(token_row(kv, table, pos, block, row_width)) + out_col;
    for (int c = threadIdx.x; c < d; c += COMP_THREADS) {
        const int r = c - (d - rope_dim);
        float y = entry[c] * rstd * norm[c];
        if (r >= 0) {
            const float angle = (float)first * inv_freq[r / 2], cs = cosf(angle), sn = sinf(angle);
            const int mate = c + (r % 2 ? -1 : 1);
            const float z = entry[mate] * rstd * norm[mate];
            y = r % 2 ? y * cs + z * sn : y * cs - z * sn;
        }
        out[c] = f_to_bf16(y);
    }
}
