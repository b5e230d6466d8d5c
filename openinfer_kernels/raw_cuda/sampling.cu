// Sampling on the GPU with the semantics of engine/sampling.py (the host reference), per row:
//   apply_penalties:  logit_bias, the min_tokens stop-token mask, repetition / frequency / presence
//                     penalties, from a per-row list of distinct tokens (CSR) built by the host.
//   sample_filtered:  p = softmax(x / temperature); min_p (drop p < min_p·max p); top_k (keep p >= the
//                     k-th largest, ties kept); top_p (keep, in descending order, tokens whose mass before
//                     them is < top_p of the total: the crossing token is kept); then an inverse-CDF draw
//                     over token ids with the row's uniform u (default_rng([seed, step]).random(): the
//                     host's, or seeded_uniforms' on the device, the same bits).
//   mask_logits:      structured output: each row's grammar bitmask (int32 words, bit v % 32 of word v / 32
//                     set: token v allowed) applied, disallowed tokens -> -inf; rows without a grammar copied.
// Thresholds are found exactly by bit-wise descent on the (non-negative) float bit patterns, so no
// sort is needed: top_k takes 31 counting steps, top_p 31 summing steps; each is a pass over V until
// at most KEPT elements can still matter, then a pass over those, compacted into shared memory (a
// top_k of 50 is a few passes over V; a top_p whose nucleus holds more than KEPT tokens stays on full
// passes); rows without them skip those steps. One block of 1024 threads per row.
// Roofline: each pass reads V·4 bytes (0.6 MB at V = 152K) from L2; ~65 passes worst case keep one SM
// busy for a few hundred µs, so only rows that sample (temperature > 0) take this path; greedy rows use
// argmax_logprob.
#include "common.cuh"

#define NT 1024

// Exclusive prefix sum over the block (thread order); also returns the total.
__device__ double block_exclusive_scan(double v, double* total, double* s /* [32] */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double incl = v;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();
    if (lane == 31) s[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        double w = s[lane], wi = w;
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double n = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += n;
        }
        s[lane] = wi - w;                  // exclusive prefix of warp totals
        if (lane == 31) s[32] = wi;
    }
    __syncthreads();
    *total = s[32];
    return s[warp] + incl - v;
}

__device__ double block_sum_d(double v, double* s) {
    double total;
    block_exclusive_scan(v, &total, s);
    return total;
}

__device__ float block_max_f(float v, float* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) s[warp] = v;
    __syncthreads();
    return warp_max(s[lane]);
}

// ---- The seeded uniform of engine/sampling.py: u = numpy.random.default_rng([seed, step]).random() ----
// numpy's SeedSequence (a 4-word entropy pool mixed from the words [seed, step], then 8 state words),
// PCG64 seeded from them (128-bit LCG, XSL-RR output), one 53-bit double. Exact for seed, step < 2^32.
// __host__ too, so the same code can be checked against numpy on a machine without a GPU.
typedef unsigned long long u64;

__host__ __device__ inline u64 mulhi64(u64 a, u64 b) {
#ifdef __CUDA_ARCH__
    return __umul64hi(a, b);
#else
    return (u64)(((unsigned __int128)a * b) >> 64);
#endif
}
__host__ __device__ inline unsigned seq_hashmix(unsigned v, unsigned& h) {
    v ^= h; h *= 0x931e8875u; v *= h; return v ^ (v >> 16);
}
__host__ __device__ inline unsigned seq_mix(unsigned x, unsigned y) {
    const unsigned r = 0xca01f9ddu * x - 0x4973f715u * y;
    return r ^ (r >> 16);
}
__host__ __device__ inline void pcg_step(u64& hi, u64& lo, u64 inc_hi, u64 inc_lo) {   // state·M + inc mod 2^128
    const u64 mh = 2549297995355413924ull, ml = 4865540595714422341ull;
    const u64 plo = lo * ml, phi = mulhi64(lo, ml) + lo * mh + hi * ml;
    lo = plo + inc_lo;
    hi = phi + inc_hi + (lo < plo ? 1ull : 0ull);
}
__host__ __device__ inline double seeded_uniform(unsigned seed, unsigned step) {
    unsigned h = 0x43b0d7e5u, pool[4];
    pool[0] = seq_hashmix(seed, h); pool[1] = seq_hashmix(step, h);
    pool[2] = seq_hashmix(0u, h); pool[3] = seq_hashmix(0u, h);
    for (int src = 0; src < 4; ++src)
        for (int dst = 0; dst < 4; ++dst)
            if (src != dst) pool[dst] = seq_mix(pool[dst], seq_hashmix(pool[src], h));
    unsigned hb = 0x8b51f9ddu;
    u64 w[4];
    for (int i = 0; i < 8; ++i) {
        unsigned v = pool[i & 3] ^ hb;
        hb *= 0x58f38dedu; v *= hb; v ^= v >> 16;
        w[i >> 1] = (i & 1) ? (w[i >> 1] | ((u64)v << 32)) : (u64)v;
    }
    const u64 inc_hi = (w[2] << 1) | (w[3] >> 63), inc_lo = (w[3] << 1) | 1ull;
    u64 hi = 0, lo = 0;
    pcg_step(hi, lo, inc_hi, inc_lo);
    const u64 lo2 = lo + w[1];
    hi += w[0] + (lo2 < lo ? 1ull : 0ull); lo = lo2;
    pcg_step(hi, lo, inc_hi, inc_lo);
    pcg_step(hi, lo, inc_hi, inc_lo);
    const u64 x = hi ^ lo;
    const unsigned rot = (unsigned)(hi >> 58);
    const u64 out = (x >> rot) | (x << ((64u - rot) & 63u));
    return (double)(out >> 11) * (1.0 / 9007199254740992.0);
}

// uniform[r] < 0 (the host's mark: seed and step fit 32 bits) -> seeded_uniform(seed[r], step[r]);
// other rows keep the uniform the host drew. One thread per row.
extern "C" __global__ void seeded_uniforms(const unsigned* __restrict__ seed, const unsigned* __restrict__ step,
                                           double* __restrict__ uniform, int n) {
    pdl_begin();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < n && uniform[r] < 0.0) uniform[r] = seeded_uniform(seed[r], step[r]);
}

extern "C" __global__ void apply_penalties(float* __restrict__ logits, int V, const int* __restrict__ row_ptr,
                                           const int* __restrict__ tokens, const float* __restrict__ bias,
                                           const int* __restrict__ flags,      // 1: masked, 2: in history
                                           const int* __restrict__ out_counts, const float* __restrict__ rep,
                                           const float* __restrict__ freq, const float* __restrict__ pres) {
    pdl_begin();
    const int r = blockIdx.x;
    float* x = logits + (size_t)r * V;
    for (int e = row_ptr[r] + threadIdx.x; e < row_ptr[r + 1]; e += blockDim.x) {
        const int t = tokens[e];
        float v = x[t] + bias[e];
        if (flags[e] & 1) v = -INFINITY;
        if ((flags[e] & 2) && rep[r] != 1.f) v = v > 0.f ? v / rep[r] : v * rep[r];
        const int c = out_counts[e];
        if (c > 0) v = (float)((double)v - ((double)freq[r] * c + (double)pres[r]));
        x[t] = v;
    }
}

// out[r, v] = in[r, v] where row r has no grammar (flags[r] == 0) or its bitmask row allows v, else
// -inf (ids past 32·words too). in == out masks in place (an unflagged row is then left untouched).
// Grid (chunks, rows), any block size. Roofline: one read + one write of V·4 bytes per row plus V/8
// bytes of mask: ~1.2 MB per 152K row, a few µs per row at H200 bandwidth; rows run in parallel.
extern "C" __global__ void mask_logits(const float* in, float* out, int V, const int* __restrict__ bitmask,
                                       int words, const int* __restrict__ flags) {
    pdl_begin();
    const int r = blockIdx.y;
    const bool on = flags[r] != 0;
    if (!on && in == out) return;
    const float* x = in + (size_t)r * V;
    float* y = out + (size_t)r * V;
    const unsigned* m = reinterpret_cast<const unsigned*>(bitmask) + (size_t)r * words;
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < V; v += gridDim.x * blockDim.x) {
        float val = x[v];
        if (on) {
            const int w = v >> 5;
            if (w >= words || !((m[w] >> (v & 31)) & 1u)) val = -INFINITY;
        }
        y[v] = val;
    }
}

__device__ __forceinline__ unsigned bits(float p) { return __float_as_uint(p); }

#define KEPT 4096
// kept[0, *n_kept) = the bit patterns of p's elements above `floor` (strictly, or >= when not), in
// row order (contiguous id segments per thread, placed by a block scan); at most KEPT of them. All
// threads call it; it ends with a barrier.
__device__ void compact(const float* p, int V, unsigned floor, bool strict, unsigned* kept, int* n_kept,
                        double* sd) {
    const int seg = (V + NT - 1) / NT, lo = min(V, (int)threadIdx.x * seg), hi = min(V, lo + seg);
    double mine = 0.0;
    for (int v = lo; v < hi; ++v) mine += (strict ? bits(p[v]) > floor : bits(p[v]) >= floor) ? 1.0 : 0.0;
    double total;
    int at = (int)block_exclusive_scan(mine, &total, sd);
    for (int v = lo; v < hi; ++v) {
        const unsigned b = bits(p[v]);
        if (strict ? b > floor : b >= floor) kept[at++] = b;
    }
    if (threadIdx.x == 0) *n_kept = (int)total;
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(NT)
sample_filtered(const float* __restrict__ logits, int V, const int* __restrict__ rows, float* __restrict__ probs,
                const float* __restrict__ temperature, const float* __restrict__ min_p,
                const int* __restrict__ top_k, const float* __restrict__ top_p,
                const double* __restrict__ uniform, int* __restrict__ out_ids) {
    pdl_begin();
    __shared__ double sd[33];
    __shared__ float sf[33];
    // Block b samples logits row rows[b] (rows null: row b); params, uniform and the probs scratch are
    // indexed by b. A block whose temperature is not > 0 (a greedy or padded row of a decode graph,
    // which launches one block per row) leaves its row's id as it is.
    const int r = blockIdx.x, tid = threadIdx.x, row = rows != nullptr ? rows[r] : r;
    const float temp = temperature[r];
    if (!(temp > 0.f)) return;
    const float* x = logits + (size_t)row * V;
    float* p = probs + (size_t)r * V;

    // softmax(x / T) in float32, as the reference.
    float m = -INFINITY;
    for (int v = tid; v < V; v += NT) m = fmaxf(m, x[v] / temp);
    m = block_max_f(m, sf);
    float s = 0.f;
    for (int v = tid; v < V; v += NT) { const float e = expf(x[v] / temp - m); p[v] = e; s += e; }
    s = block_sum(s, sf);
    float pmax = 0.f;
    for (int v = tid; v < V; v += NT) { p[v] = p[v] / s; pmax = fmaxf(pmax, p[v]); }
    pmax = block_max_f(pmax, sf);

    if (min_p[r] > 0.f) {
        const double cut = (double)min_p[r] * pmax;
        for (int v = tid; v < V; v += NT) if ((double)p[v] < cut) p[v] = 0.f;
    }
    __syncthreads();
    // The threshold searches below pass over the whole row until few enough elements (at most KEPT)
    // can still matter, then over those, compacted into shared memory in row order.
    __shared__ unsigned kept[KEPT];
    __shared__ int n_kept;
    const int k = top_k[r];
    if (k > 0 && k < V) {   // the k-th largest value: the largest b with count(p >= b) >= k
        unsigned prefix = 0;
        float n_ge = (float)V;                           // count(p >= prefix)
        bool listed = false;                             // kept[] holds every p >= the prefix then
        for (int bit = 30; bit >= 0; --bit) {
            if (!listed && n_ge <= (float)KEPT) { compact(p, V, prefix, false, kept, &n_kept, sd); listed = true; }
            const unsigned cand = prefix | (1u << bit);
            float c = 0.f;
            if (listed) for (int i = tid; i < n_kept; i += NT) c += kept[i] >= cand ? 1.f : 0.f;
            else for (int v = tid; v < V; v += NT) c += bits(p[v]) >= cand ? 1.f : 0.f;
            c = block_sum(c, sf);
            if (c >= (float)k) { prefix = cand; n_ge = c; }
        }
        for (int v = tid; v < V; v += NT) if (bits(p[v]) < prefix) p[v] = 0.f;
        __syncthreads();
    }
    // Contiguous id segments per thread for the ordered steps below.
    const int seg = (V + NT - 1) / NT, lo = min(V, tid * seg), hi = min(V, lo + seg);
    if (top_p[r] < 1.f) {
        double total_mass = 0.0;
        for (int v = tid; v < V; v += NT) total_mass += p[v];
        total_mass = block_sum_d(total_mass, sd);
        const double P = (double)top_p[r] * total_mass;
        // v_c = 1 + the largest b with mass(p > b) >= P: the value of the last kept token.
        unsigned prefix = 0;
        float n_gt = (float)V;                           // count(p > prefix), an upper bound at first
        bool listed = false;                             // kept[] holds every p > the prefix then
        for (int bit = 30; bit >= 0; --bit) {
            if (!listed && n_gt <= (float)KEPT) { compact(p, V, prefix, true, kept, &n_kept, sd); listed = true; }
            const unsigned cand = prefix | (1u << bit);
            double above = 0.0;
            float c = 0.f;
            if (listed) {
                for (int i = tid; i < n_kept; i += NT) if (kept[i] > cand) above += (double)__uint_as_float(kept[i]);
            } else {
                for (int v = tid; v < V; v += NT) if (bits(p[v]) > cand) { above += p[v]; c += 1.f; }
            }
            if (block_sum_d(above, sd) >= P) {
                prefix = cand;
                if (!listed) n_gt = block_sum(c, sf);
            }
        }
        const unsigned vc = prefix + 1;
        double above = 0.0;
        for (int v = tid; v < V; v += NT) if (bits(p[v]) > vc) above += p[v];
        above = block_sum_d(above, sd);
        // Ties at v_c are kept in id order while the mass before them stays below P.
        const double pv = (double)__uint_as_float(vc);
        double n_equal = 0.0;
        for (int v = lo; v < hi; ++v) n_equal += bits(p[v]) == vc ? 1.0 : 0.0;
        double all_equal;
        double j = block_exclusive_scan(n_equal, &all_equal, sd);
        for (int v = lo; v < hi; ++v) {
            const unsigned b = bits(p[v]);
            if (b < vc) p[v] = 0.f;
            else if (b == vc) { if (!(above + j * pv < P)) p[v] = 0.f; j += 1.0; }
        }
        __syncthreads();
    }
    // Inverse CDF over token ids: the first id whose cumulative mass exceeds u · total.
    double seg_mass = 0.0;
    for (int v = lo; v < hi; ++v) seg_mass += p[v];
    double total;
    const double before = block_exclusive_scan(seg_mass, &total, sd);
    const double target = uniform[r] * total;
    __shared__ int chosen;
    if (tid == 0) chosen = V;
    __syncthreads();
    if (before <= target && target < before + seg_mass) {
        double c = before;
        for (int v = lo; v < hi; ++v) { c += p[v]; if (c > target) { atomicMin(&chosen, v); break; } }
    }
    __syncthreads();
    if (tid == 0) {
        int t = chosen;
        if (t >= V) { t = V - 1; while (t > 0 && p[t] == 0.f) --t; }   // rounding at the very end
        out_ids[row] = t;
    }
}
