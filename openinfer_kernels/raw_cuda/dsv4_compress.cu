// DeepSeek-V4's compressor closing its windows (engine/executor/cpu_dsv4_attention.py close_entries /
// compress_windows, transformers' DeepseekV4Compressor): a step token at position p with (p + 1) % rate == 0
// closes the window of positions first = p + 1 - rate .. p, whose entry [d] is, per column c, the softmax over
// the window's slots of gate + ape (the learned position bias) weighting the slots' kv, then RMSNorm over the
// d columns (times norm), then the interleaved rope of its trailing rope_dim columns at position `first`; it is
// stored as bf16 in the closing token's own KV row (its slot; -1: a padding or replayed token, nothing written)
// at out_col (cpu_dsv4_attention.entry_columns: the entry at D, CSA's indexer key at 2·D). With overlap (CSA, and
// every indexer key) each token holds two series [kv: a | b, gate: a | b] and the entry's slots are the previous
// window's series a (none for window 0) then its own series b. Other tokens' CTAs return at once: a launch over
// the step's tokens has fixed shapes and no host reads (graph-capturable).
//
// A token's compressor inputs (kv | gate from column src, s · d each, s = 2 with overlap; width values a token)
// are where the compact cache keeps them: positions at or past the sequence's first position in the step
// (start) in the step's own float32 rows `inputs` (for the token at pos in row r: position p in row r - (pos - p)),
// earlier ones in the sequence's ring, the bf16 [slots · ring_len, width] inputs of each state slot's last
// ring_len positions (position p at row slot · ring_len + p % ring_len; ring_len >= the window's reach: 2 · rate
// with overlap, rate without). Nothing a CTA reads is written by the launch.
//
// Roofline per closing token: reads (1 + overlap) · rate slots · 2 · d values, bf16 from the ring and float32
// from the step's rows (at decode all but the token's own from the ring: CSA's entry of 512, 16 KB; HCA's, 128
// slots, 256 KB; the indexer's key of 128, 4 KB) and writes 2 · d bytes, once per rate tokens: a few µs of one SM
// per launch at decode, latency-bound like the other per-layer small kernels. ring_store writes 2 · width bytes a
// token (V4-Flash: 5 KB a CSA layer, 2 KB an HCA one).
//
// ring_store (below): after the step's windows are closed, each token's inputs [width] stored as bf16 in its
// sequence's ring at row slot · ring_len + p % ring_len (position -1: not stored).
#include "common.cuh"

#define COMP_THREADS 128
#define COMP_MAX_D 1024                 // entry width held in shared memory for the norm and the rope

// Where one closing token's window inputs are: the step's rows up to its own (row, at pos), the ring before start.
struct WindowInputs {
    const float* step;
    const bf16_t* ring;
    int row, pos, start, ring_base, ring_len, width;

    __device__ __forceinline__ float at(int p, int col) const {
        return p >= start ? step[(size_t)(row - (pos - p)) * width + col]
                          : bf16_to_f(ring[(size_t)(ring_base + p % ring_len) * width + col]);
    }
};

// Column c's softmax-weighted kv over the window's slots (slot j < rate of the previous window with overlap:
// its series a; then the window's own slots: series b with overlap, the only series without).
__device__ float window_sum(const WindowInputs& in, const float* ape, int first, int c, int d, int overlap,
                           int rate, int src) {
    const int sd = (1 + overlap) * d, own = overlap ? d : 0, j0 = overlap && first > 0 ? 0 : rate * overlap;
    const int slots = rate * (1 + overlap);
    float mx = -INFINITY;
    for (int j = j0; j < slots; ++j) {
        const bool prev = j < rate * overlap;
        const int jj = prev ? j : j - rate * overlap, p = first + jj - (prev ? rate : 0), col = prev ? c : own + c;
        mx = fmaxf(mx, in.at(p, src + sd + col) + ape[jj * sd + col]);
    }
    float sum = 0.f, acc = 0.f;
    for (int j = j0; j < slots; ++j) {
        const bool prev = j < rate * overlap;
        const int jj = prev ? j : j - rate * overlap, p = first + jj - (prev ? rate : 0), col = prev ? c : own + c;
        const float e = expf(in.at(p, src + sd + col) + ape[jj * sd + col] - mx);
        sum += e;
        acc += e * in.at(p, src + col);
    }
    return acc / sum;
}

// compress_close: grid (T), COMP_THREADS threads. kv: the layer's bf16 KV rows [slots, kv_width]; ring: the
// layer's bf16 ring [state slots · ring_len, width]; inputs float32 [rows, width]: the step's; per token t:
// positions (-1: padding), slots (its KV slot, -1: none written), starts (its sequence's first position in the
// step) and ring_slots (its sequence's state slot), int32 [T]; its inputs are row t;
// ape float32 [rate, s · d]; norm float32 [d]; inv_freq float32 [rope_dim / 2]; d <= COMP_MAX_D.
extern "C" __global__ void __launch_bounds__(COMP_THREADS)
compress_close(bf16_t* kv, const bf16_t* __restrict__ ring, const float* __restrict__ inputs,
               const int* __restrict__ positions, const int* __restrict__ slots, const int* __restrict__ starts,
               const int* __restrict__ ring_slots, const float* __restrict__ ape,
               const float* __restrict__ norm, const float* __restrict__ inv_freq, int kv_width, int ring_len,
               int width, int src, int d, int overlap, int rate, int rope_dim, int out_col, float eps) {
    pdl_begin();
    __shared__ float entry[COMP_MAX_D], scratch[33];
    const int t = blockIdx.x, pos = positions[t], slot = slots[t];
    if (pos < 0 || (pos + 1) % rate || slot < 0) return;                // the whole CTA
    const int first = pos + 1 - rate;
    const WindowInputs in{inputs, ring, t, pos, starts[t], ring_slots[t] * ring_len, ring_len, width};
    float sq = 0.f;
    for (int c = threadIdx.x; c < d; c += COMP_THREADS) {
        const float v = window_sum(in, ape, first, c, d, overlap, rate, src);
        entry[c] = v;
        sq += v * v;
    }
    const float rstd = 1.f / sqrtf(block_sum(sq, scratch) / d + eps);   // its barriers: entry[] complete
    bf16_t* out = kv + (size_t)slot * kv_width + out_col;
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

// ring_store: grid (T), COMP_THREADS threads. rows float32 [T, width] -> ring[ring_slots[t] · ring_len +
// positions[t] % ring_len] as bf16, where positions[t] >= 0.
extern "C" __global__ void __launch_bounds__(COMP_THREADS)
ring_store(bf16_t* ring, const int* __restrict__ positions, const int* __restrict__ ring_slots,
           const float* __restrict__ rows, int ring_len, int width) {
    pdl_begin();
    const int t = blockIdx.x, pos = positions[t];
    if (pos < 0 || ring_slots[t] < 0) return;
    bf16_t* out = ring + ((size_t)ring_slots[t] * ring_len + pos % ring_len) * width;
    for (int c = threadIdx.x; c < width; c += COMP_THREADS) out[c] = f_to_bf16(rows[(size_t)t * width + c]);
}
