"""DeepSeek-V4's op family on the GPU (ops.dsv4; models/ops.py DSV4Ops), a part GpuOps builds for that line over
the executor's GpuShared and its MoE part. The hyper-connections are raw CUDA kernels (dsv4_hc.cu, one launch
each, nothing read back on the host):
  hyper_connection   hc_pre         the mixes of the RMS-normed streams, pre / post / comb with the Sinkhorn
                                    iterations, the streams collapsed by pre into the block's bf16 input
  hc_merge           hc_post_*      post · block output + the comb-mixed streams
  hyper_head         hc_head        the final collapse
and so are the compressor closing its windows (dsv4_compress.cu, compress_windows: the entry and the indexer key
of each window a step token closes, from the step's float32 inputs and the sequence's ring, written into its KV
row; ring_store: the step's last inputs into the ring), the lightning indexer (dsv4_indexer.cu:
indexer_scores, then indexer_topk, each query's top index_topk entries on the device) and the attention itself,
for every step (dsv4_attention.cu: write_rows stores the step's K rows, sparse_decode attends each row over its window and entries
with the sinks; device_attention below), the per-head RMSNorm and rope of q, of the K = V row and of the indexer's
queries, the q LoRA's norm and the rope undone on the output
(dsv4_norm_rope.cu: norm_rope, one launch each, in place), the limited SwiGLU (the MoE part's silu_mul.cu
silu_mul_limited, the shared expert's too) and the hash router (moe_route.cu moe_hash_route). The rest around the
attention runs as CuPy float32 over the bf16 weights, every projection on the executor's bf16 GEMM (float32 out) but
the grouped output projection's wo_a, which runs on the MoE part's grouped products over its bf16 weight, group g as
expert g (grouped_linear: moe_gemv.cu for a few tokens, the grouped GEMM otherwise; no float32 copy), the routed
experts on the MoE part (gpu_moe_ops.py, whose moe_route.cu also takes the sqrtsoftplus router).

The compact cache (issue 58): a KV row per token and layer holds K = V and, at a window's closing token, the
entry and the indexer key (entry_columns); the compressor's inputs live in the per-sequence ring, the line's
state arrays ("csa_ring", "hca_ring": bf16 [layers, state slots, ring_len, ring_width], the executor's, handed
over at construction) at row p % ring_len of the sequence's state slot.

Every step reads only its device arrays (positions, slots, state slots, block tables, token rows). Decode steps
have shapes fixed by the row count, so the executor captures them in CUDA graphs (DeepseekV4ForCausalLM.cuda_graphs);
their CuPy temporaries come from the graphs' own memory pool (gpu_graphs.capture_memory). Prefill and mixed steps run
eager through the same kernels, a prompt's rows each as a query at its own position (the numpy executor's
cpu_dsv4_attention.dsv4_attention is the definition they are gated against).
"""
from __future__ import annotations

import numpy as np

from engine.executor.attention_grid import sparse_heads_per_cta
from engine.executor.cpu_dsv4_attention import entry_columns, norm_rope, out_projection, project
from engine.executor.gpu_bf16 import bf16_to_f32, elementwise, f32_to_bf16
from engine.executor.gpu_moe_ops import expert_tile_m
from memory.kv_pool import BLOCK_SIZE
from openinfer_kernels.raw_cuda import kernel

WEIGHT_F32_CACHE = 1 << 22      # weights of at most this many elements keep a float32 copy on the device
HC_THREADS = 256                # dsv4_hc.cu HC_THREADS (hc_pre, hc_head)
HC_POST_THREADS = 128           # dsv4_hc.cu HC_POST_THREADS (hc_merge)
HC_CHUNK = 1024                 # dsv4_hc.cu HC_CHUNK: flat-row values per CTA of the mixes
HC_MAX_SLICES = 64              # dsv4_hc.cu HC_MAX_SLICES: CTAs a row at most
MAX_HC_MULT = 5                 # dsv4_hc.cu: the comb matrix (hc_mult² values) in one warp's lanes
IDX_THREADS = 128               # dsv4_indexer.cu: entries per CTA of indexer_scores
TOPK_THREADS = 256              # dsv4_indexer.cu: threads of indexer_topk's CTA (one a query row)
COMP_THREADS = 128              # dsv4_compress.cu: threads of compress_close's and ring_store's CTA (a token)
ATT_THREADS = 256               # dsv4_attention.cu: threads of sparse_decode's CTA (a row, a group of heads), write_rows'
INDEXER_SCORES_BYTES = 1 << 28  # the indexer's float32 scores of a step's rows held at once (rows · stride · 4)
NR_THREADS, NR_PER = 128, 8     # dsv4_norm_rope.cu: threads of norm_rope's CTA (a row), values a thread holds
# Steps of at least this many rows attend on dsv4_sparse_mma.cu's sparse_prefill (tensor cores), fewer on
# sparse_decode (GpuDSV4Ops.sparse_mma_rows; None: sparse_decode always). H200, 2026-12-07, V4-Flash 1 x 8,192
# prefill: 112.5 -> 10.5 ms for 4 layers; a CTA a row takes ~40 µs, so below about a wave of rows the head-grouped
# sparse_decode is the faster (the crossover itself not yet measured).
SPARSE_MMA_ROWS = 64
SPARSE_MMA_BN, SPARSE_MMA_STAGES, SPARSE_MMA_CHUNK = 16, 3, 1024   # dsv4_sparse_mma.cu SM_BN, SM_STAGES, SM_CHUNK
SMEM_PER_BLOCK = 227 * 1024     # Hopper's opt-in shared memory a CTA (a head dim past ~900 stays on sparse_decode)


def sparse_mma_heads(heads: int) -> int:
    """16-head tiles a CTA of sparse_prefill takes (SM_MW): all of a row's heads up to 64."""
    return min(4, -(-heads // 16))


def sparse_smem_bytes(d: int, tiles: int) -> int:
    """sparse_prefill's dynamic shared memory (its SparseSmem): Q and the key stages as bf16 rows of d + 8, the
    warps' partial S fragments, the chunk's slots."""
    pitch = 2 * (d + 8)
    return 16 * tiles * pitch + SPARSE_MMA_STAGES * SPARSE_MMA_BN * pitch + 2 * tiles * 256 * 4 + 4 * SPARSE_MMA_CHUNK


def check_hc_shapes(hc_mult: int, hidden: int) -> None:
    """dsv4_hc.cu's limits, refused at start."""
    if not 1 <= hc_mult <= MAX_HC_MULT or hidden % 4 or hc_mult * hidden > HC_CHUNK * HC_MAX_SLICES:
        raise ValueError(f"deepseek_v4 on the GPU: the hyper-connection kernels take hc_mult 1..{MAX_HC_MULT} "
                         f"(got {hc_mult}), a hidden size that is a multiple of 4 (got {hidden}) and hc_mult · hidden "
                         f"<= {HC_CHUNK * HC_MAX_SLICES}")


def group_layout(cp, tokens: int, groups: int):
    """The rows of `groups` groups of the same `tokens` tokens as the MoE part's grouped products take them, group g
    as expert g (moe_align.cu's layout): each group's rows padded to whole M-tiles (expert_tile_m), its tokens at
    the top. Returns (tile_m, rows per group, tile_expert [tiles], row_token [groups · rows per group], -1 on
    padding rows), made on the device alone: fixed by tokens and groups, a CUDA graph holds them."""
    tile_m = expert_tile_m(tokens, groups, groups)
    tiles = -(-tokens // tile_m)
    rows = tiles * tile_m
    k = elementwise(cp, "dsv4_group_layout", "int32 tokens, int32 rows, int32 tiles, int32 n_tiles",
                    "raw int32 tile_expert, raw int32 row_token",
                    "const int r = i % rows; row_token[i] = r < tokens ? r : -1; if (i < n_tiles) tile_expert[i] = i / tiles")
    if k is not None:                # one launch (a graph node) for both
        tile_expert, row_token = cp.empty(groups * tiles, np.int32), cp.empty(groups * rows, np.int32)
        k(np.int32(tokens), np.int32(rows), np.int32(tiles), np.int32(groups * tiles), tile_expert, row_token,
          size=groups * rows)
        return tile_m, rows, tile_expert, row_token
    tile_expert = cp.arange(groups * tiles, dtype=np.int32) // np.int32(tiles)
    row = cp.arange(groups * rows, dtype=np.int32) % np.int32(rows)
    return tile_m, rows, tile_expert, cp.where(row < tokens, row, np.int32(-1))


class GpuDSV4Ops:
    """ops.dsv4 on CuPy arrays, on the executor's stream; moe: the executor's MoE part (its router logits); state:
    the line's state arrays (name -> bf16 [layers, slots, ring_len, ring_width]; None: no compressed layer);
    array_module: CuPy, unless given (the tests' host emulation passes numpy's stand-in)."""

    @staticmethod
    def pool_nbytes(plan) -> int:
        """The CuPy pool's bytes an eager step of plan.max_tokens tokens takes at its peak, outside the arena (the
        executor leaves them free): a token's ~6 float32 rows of the heads (q with its rms and rope temporaries, the
        attention's out and its rope undone, the grouped projection's bf16 rows) and ~4 of the hyper-connection
        streams (at most MAX_HC_MULT of the hidden size), and the indexer's scores (INDEXER_SCORES_BYTES).
        V4-Flash at 8,192 tokens: 8.8 GiB."""
        heads = plan.num_heads * plan.head_dim * 4
        return plan.max_tokens * (6 * heads + 4 * MAX_HC_MULT * plan.hidden * 4) + INDEXER_SCORES_BYTES

    def __init__(self, shared, moe, state: dict | None = None, array_module=None):
        if array_module is None:
            import cupy as array_module

        self.shared, self.moe, self.state, self.cp = shared, moe, state, array_module
        self._kept_weights: dict = {}       # (id(weight), form) -> (weight, converted)
        self._kernels: dict = {}
        self._hc_counter = None             # dsv4_hc.cu's per-row counters (zero between launches)
        self.sparse_mma_rows = SPARSE_MMA_ROWS

    def _f(self, a):
        return bf16_to_f32(self.cp, a)

    def _b(self, a):
        return f32_to_bf16(self.cp, a)

    def _weight_f32(self, w):
        """A weight's float32 values, converted once and kept for weights up to WEIGHT_F32_CACHE elements (the
        norms, sinks, hyper-connection and router tables); the large projections go through the bf16 GEMM and the
        grouped products (grouped_linear), none converted."""
        if w.dtype == np.float32 or w.size > WEIGHT_F32_CACHE:
            return self._f(w)
        return self._kept(w, "f32", self._f)

    def _kept(self, w, form: str, convert):
        """convert(w), computed on first use and kept with w (held, so its id stays its own)."""
        hit = self._kept_weights.get((id(w), form))
        if hit is None:
            hit = self._kept_weights[(id(w), form)] = (w, convert(w))
        return hit[1]

    def _kernel(self, name: str, entry: str, dynamic_smem: int = 0, **defines: int):
        """<name>.cu's entry compiled with the given constants (dsv4_hc: HC_N; dsv4_indexer: IDX_H, IDX_D), allowed
        `dynamic_smem` bytes of dynamic shared memory (set once, when compiled: before any capture replays it)."""
        key = (name, entry, tuple(sorted(defines.items())))
        if key not in self._kernels:
            self._kernels[key] = kernel(name, entry, **defines)
            if dynamic_smem:
                self._kernels[key].max_dynamic_shared_size_bytes = dynamic_smem
        return self._kernels[key]

    def _bf16_weight(self, w):
        """A weight as bf16 bits (the device holds them so; a float32 one is converted once and kept)."""
        return w if w.dtype == np.uint16 else self._kept(w, "bf16", self._b)

    # ---- residual streams: dsv4_hc.cu ------------------------------------------------------------------
    def hc_streams(self, x, n: int):
        with self.shared.stream:
            return self.cp.repeat(self._f(x)[:, None, :], n, axis=1)

    def _mix_launch(self, entry: str, streams, mixes: int, args: tuple) -> None:
        """hc_pre / hc_head over streams [T, N, D]: S CTAs a row of at most HC_THREADS threads (a warp per 128
        values of a CTA's slice, more than `mixes`), their (partial, counter) workspace after the weights."""
        T, N, D = streams.shape
        check_hc_shapes(N, D)
        splits, width = -(-N * D // HC_CHUNK), min(N * D, HC_CHUNK)
        threads = min(HC_THREADS, 32 * max(-(-width // 128), -(-(mixes + 1) // 32)))    # whole warps, > mixes
        if self._hc_counter is None or self._hc_counter.shape[0] < T:      # once: a graph holds its address
            self._hc_counter = self.cp.zeros(max(T, 64, getattr(self.shared, "max_tokens", 0)), np.int32)
        work = (self.cp.empty(T * splits * (mixes + 1), np.float32), self._hc_counter)
        self.shared.launch(self._kernel("dsv4_hc", entry, HC_N=N), (splits, T), (threads,),
                           (self.cp.ascontiguousarray(streams), *args[:3], *work, *args[3:]))

    def hyper_connection(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        """hc_pre: (post [T, N] float32, comb [T, N, N] float32, the block's input bf16 [T, D]) in one launch."""
        T, N, D = streams.shape
        with self.shared.stream:
            post, comb = self.cp.empty((T, N), np.float32), self.cp.empty((T, N, N), np.float32)
            x = self.cp.empty((T, D), np.uint16)
            if T:
                self._mix_launch("hc_pre", streams, (2 + N) * N,
                                 (self._bf16_weight(fn), self._weight_f32(base), self._weight_f32(scale), post, comb,
                                  x, np.int32(D), np.int32(iters), np.float32(hc_eps), np.float32(norm_eps)))
            return post, comb, x

    def hc_merge(self, block_out, streams, post, comb):
        """hc_post_f32 / hc_post_bf16 (the block's output as it comes): the new streams [T, N, D] float32."""
        T, N, D = streams.shape
        with self.shared.stream:
            out = self.cp.empty((T, N, D), np.float32)
            if T:
                entry = "hc_post_bf16" if block_out.dtype == np.uint16 else "hc_post_f32"
                self.shared.launch(self._kernel("dsv4_hc", entry, HC_N=N), (-(-T * D // (4 * HC_POST_THREADS)),),
                                   (HC_POST_THREADS,),
                                   (self.cp.ascontiguousarray(block_out), self.cp.ascontiguousarray(streams),
                                    post, comb, out, np.int32(T), np.int32(D)))
            return out

    def hyper_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        """hc_head: the streams [T, N, D] collapsed to bf16 [T, D] by the head's pre weights."""
        T, N, D = streams.shape
        with self.shared.stream:
            x = self.cp.empty((T, D), np.uint16)
            if T:
                self._mix_launch("hc_head", streams, N,
                                 (self._bf16_weight(fn), self._weight_f32(base), self._weight_f32(scale), x,
                                  np.int32(D), np.float32(hc_eps), np.float32(norm_eps)))
            return x

    # ---- MLP -------------------------------------------------------------------------------------------
    def swiglu_limited(self, gate_up, limit):
        """The shared expert's limited SwiGLU on the MoE part's activation (silu_mul.cu's silu_mul_limited)."""
        with self.shared.stream:
            out = self.cp.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.uint16)
            self.moe.expert_activation(self.cp.ascontiguousarray(gate_up), out, limit)
            return out

    def hash_route(self, x, gate_weight, tid2eid, spec, ctx):
        """The experts tid2eid[token] (held as bf16: exact for ids below 256, checked at start by the line) and
        their weights: moe_route.cu's moe_hash_route over the router's logits, one launch."""
        logits = self.moe.router_logits(x, gate_weight)
        with self.shared.stream:
            table = self._kept(tid2eid, "int32", lambda t: self._f(t).astype(np.int32))
            (T, E), k = logits.shape, table.shape[1]
            weights, ids = self.cp.empty((T, k), np.float32), self.cp.empty((T, k), np.int32)
            if T:
                self.shared.launch(self._kernel("moe_route", "moe_hash_route", MAX_E=self.moe.route_max_e),
                                   (-(-T // 128),), (128,),
                                   (logits, table, self.cp.asarray(ctx.input_ids[:T], np.int32), weights, ids,
                                    np.int32(T), np.int32(E), np.int32(k), np.float32(spec.scale)))
            return weights, ids

    # ---- attention: device_attention over the device kernels ----------------------------------------------
    def attention(self, x, w, spec, ctx):
        """device_attention: every step, decode graphs' and eager ones, on the device kernels."""
        with self.shared.stream:
            return device_attention(x, w, spec, ctx, self)

    def mm(self, x, weight):
        """x · weightᵀ float32 (the attention's projections): decode rows on gemv.cu's f32 entries, larger steps on
        cuBLAS / the CuTe GEMM. On cuBLAS the batch-1 graph's products and their split-K reductions took ~415 µs
        (ncu, H100, 2026-12-07) for ~0.65 GB of weights: about half the copy bandwidth."""
        xb = x if x.dtype == np.uint16 else self._b(x)
        out = self.cp.empty((x.shape[0], weight.shape[0]), np.float32)
        self.shared.gemm(self.cp.ascontiguousarray(xb), weight, out, gemv_f32=True)
        return out

    def fp32(self, weight):
        return self._weight_f32(weight)

    def norm_rope(self, x, positions, inv_freq, eps=None, weight=None, inverse=False):
        """dsv4_norm_rope.cu's norm_rope over x [T, heads, d] float32 in place (one launch; rows of more than
        NR_THREADS · NR_PER values: the composed CuPy ops)."""
        T, H, d = x.shape
        if d > NR_THREADS * NR_PER:
            return norm_rope(x, positions, inv_freq, eps, weight, inverse)
        x = self.cp.ascontiguousarray(x, np.float32)
        if T * H:
            self.shared.launch(self._kernel("dsv4_norm_rope", "norm_rope"), (T * H,), (NR_THREADS,),
                               (x, np.uint64(0) if weight is None else self.cp.ascontiguousarray(weight, np.float32),
                                self.cp.asarray(positions, np.int32), self.const(inv_freq), np.int32(H), np.int32(d),
                                np.int32(len(inv_freq)), np.float32(-1 if eps is None else eps),
                                np.float32(-1 if inverse else 1)))
        return x

    def grouped_linear(self, x, weight, groups: int):
        """The grouped output projection on the MoE part's grouped products over the bf16 weight (no float32 copy):
        x [T, groups·K] (float32, rounded to bf16, or bf16) laid out as group_layout's rows, moe_gemv.cu for a few
        tokens, the grouped GEMM otherwise (GpuMoEOps.grouped_linear), the bf16 outputs back as float32
        [T, groups·N]."""
        cp, T = self.cp, x.shape[0]
        w = self._bf16_weight(weight)
        N, K = w.shape[0] // groups, w.shape[1]
        if not T:
            return cp.zeros((0, groups * N), np.float32)
        tile_m, rows, tile_expert, row_token = group_layout(cp, T, groups)
        a, by_group = cp.empty((groups, rows, K), np.uint16), x.reshape(T, groups, K).transpose(1, 0, 2)
        a[:, :T] = by_group if x.dtype == np.uint16 else self._b(by_group)
        out = cp.empty((groups * rows, N), np.uint16)
        self.moe.grouped_linear(a.reshape(groups * rows, K), w.reshape(groups, N, K), tile_expert, row_token, out,
                                tile_m, T)
        return self._f(out.reshape(groups, rows, N)[:, :T].transpose(1, 0, 2).reshape(T, groups * N))

    def const(self, table):
        """A constant host table (the rope's inverse frequencies) on the device, kept there."""
        return self._kept(table, "dev", lambda a: self.cp.asarray(a, np.float32))

    def ring(self, spec):
        """The layer's ring, bf16 [state slots, ring_len, ring_width]."""
        return self.state[spec.ring][spec.ring_index]

    def compress_windows(self, positions, slots, starts, ring_slots, inputs, w, spec) -> None:
        """compress_close over T tokens (device int32 [T] each: positions, -1 padding; KV slots, -1 none written;
        their sequences' first positions in the step and state slots; token t's inputs are row t of the step's
        inputs [T, ring_width] float32; a token that closes no window returns at once): the entries, then the
        indexer keys, each into the closing token's KV row."""
        L, D, cols = f"layers.{spec.layer}.", spec.head_dim, entry_columns(spec)
        kv, ring = self.shared.kv_cache[spec.layer, 0], self.ring(spec)
        inv_freq = self.const(spec.compress_inv_freq)
        inputs = self.cp.ascontiguousarray(inputs, np.float32)
        series = [("comp_", 0, D, spec.overlap, cols[0])]
        if spec.index_heads:
            series.append(("idx_comp_", 2 * spec.series * D, spec.index_dim, True, cols[1]))
        for name, src, d, overlap, out in series:
            self.shared.launch(self._kernel("dsv4_compress", "compress_close"), (positions.shape[0],), (COMP_THREADS,),
                               (kv, ring, inputs, positions, slots, starts, ring_slots,
                                self._weight_f32(w[L + name + "ape"]),
                                self._weight_f32(w[L + name + "norm"]), inv_freq, np.int32(kv.shape[-1]),
                                np.int32(spec.ring_len), np.int32(spec.ring_width), np.int32(src), np.int32(d),
                                np.int32(overlap), np.int32(spec.rate), np.int32(2 * inv_freq.shape[0]),
                                np.int32(out), np.float32(spec.rms_eps)))

    def store_ring(self, spec, ring_slots, positions, rows) -> None:
        """ring_store: rows [T, ring_width] float32 as bf16 into the rings of state slots ring_slots at positions
        (device int32 [T] each; position -1: not stored)."""
        if rows.shape[0]:
            self.shared.launch(self._kernel("dsv4_compress", "ring_store"), (rows.shape[0],), (COMP_THREADS,),
                               (self.ring(spec), positions, ring_slots, self.cp.ascontiguousarray(rows, np.float32),
                                np.int32(spec.ring_len), np.int32(spec.ring_width)))

    def indexer_topk(self, layer: int, tables, q, weights, positions, spec, stride: int):
        """dsv4_indexer.cu over R query rows: each row's top entries among the (position + 1) // rate closed ones
        of its sequence (blocks tables [R, blocks] device int32; q [R, heads, d] and weights [R, heads] float32,
        the latter times heads^-0.5; positions [R] int32, -1: none; stride: the most entries a row may have).
        Returns ids [R, index_topk] int32 (ascending, -1 padded), counts [R] and the scores [R, stride] they
        were taken by (valid below each row's closed entries)."""
        cp, R, H, D = self.cp, *q.shape
        kv = self.shared.kv_cache[layer, 0]
        scores = cp.empty((R, stride), np.float32)
        ids, counts = cp.empty((R, spec.index_topk), np.int32), cp.empty(R, np.int32)
        if R and stride:
            self.shared.launch(self._kernel("dsv4_indexer", "indexer_scores", IDX_H=H, IDX_D=D),
                               (-(-stride // IDX_THREADS), R), (IDX_THREADS,),
                               (cp.ascontiguousarray(q, np.float32), cp.ascontiguousarray(weights, np.float32), kv,
                                tables, positions, scores, np.int32(stride), np.int32(tables.shape[1]),
                                np.int32(BLOCK_SIZE), np.int32(kv.shape[-1]), np.int32(entry_columns(spec)[1]),
                                np.int32(spec.rate), np.float32(D ** -0.5)))
        if R:
            self.shared.launch(self._kernel("dsv4_indexer", "indexer_topk"), (R,), (TOPK_THREADS,),
                               (scores, positions, ids, counts, np.int32(stride), np.int32(spec.rate),
                                np.int32(spec.index_topk)))
        return ids, counts, scores

    def indexer_ids(self, tables, q, weights, positions, spec, stride: int):
        """indexer_topk's ids [R, index_topk] of R rows, taken INDEXER_SCORES_BYTES of scores at a time (a prompt's
        rows over a long context would hold rows · stride float32 scores at once)."""
        R, rows = q.shape[0], max(1, INDEXER_SCORES_BYTES // (4 * max(stride, 1)))
        if R <= rows:
            return self.indexer_topk(spec.layer, tables, q, weights, positions, spec, stride)[0]
        ids = self.cp.empty((R, spec.index_topk), np.int32)
        for r in range(0, R, rows):
            part = slice(r, min(R, r + rows))
            ids[part] = self.indexer_topk(spec.layer, tables[part], q[part], weights[part], positions[part], spec,
                                          stride)[0]
        return ids

    def block_out(self, y):
        return y                            # float32: hc_merge reads it as it is

    # ---- decode on the device alone: dsv4_attention.cu ------------------------------------------------------
    def store_rows(self, layer: int, slots, rows, col: int = 0) -> None:
        """write_rows: rows [T, w] float32 as bf16 at the device slots [T] (-1: padding or a replayed position, not
        written) from column col."""
        kv = self.shared.kv_cache[layer, 0]
        if rows.shape[0]:
            self.shared.launch(self._kernel("dsv4_attention", "write_rows"), (rows.shape[0],), (ATT_THREADS,),
                               (kv, slots, self.cp.ascontiguousarray(rows, np.float32), np.int32(rows.shape[1]),
                                np.int32(kv.shape[-1]), np.int32(col)))

    def sparse_decode(self, q, tables, positions, ids, sinks, spec):
        """sparse_decode: each row's one query over its window and its entries (ids [T, topk] on CSA layers,
        every closed one on HCA layers, None on sliding ones). Returns out [T, heads, D] float32. Steps of
        sparse_mma_rows rows or more go to sparse_prefill (the same, on tensor cores)."""
        cp, (T, H, D) = self.cp, q.shape
        if (self.sparse_mma_rows is not None and T >= self.sparse_mma_rows and D % 32 == 0
                and sparse_smem_bytes(D, sparse_mma_heads(H)) <= SMEM_PER_BLOCK):
            return self.sparse_prefill(q, tables, positions, ids, sinks, spec)
        out = cp.empty((T, H, D), np.float32)
        pieces = -(-D // 128)
        group = sparse_heads_per_cta(T, H, pieces, self.shared.num_sms)
        if T:
            self.shared.launch(self._kernel("dsv4_attention", "sparse_decode", ATT_G=group, ATT_PIECES=pieces),
                               (T, H // group), (ATT_THREADS,), self._sparse_args(q, tables, positions, ids, sinks,
                                                                                 out, spec, D))
        return out

    def sparse_prefill(self, q, tables, positions, ids, sinks, spec):
        """sparse_decode's result from dsv4_sparse_mma.cu: a CTA a row and up to 64 heads, on tensor cores (q and
        the probabilities rounded to bf16 for their products). D % 32 == 0."""
        T, H, D = q.shape
        out = self.cp.empty((T, H, D), np.float32)
        tiles = sparse_mma_heads(H)
        smem = sparse_smem_bytes(D, tiles)
        if T:
            k = self._kernel("dsv4_sparse_mma", "sparse_prefill", dynamic_smem=smem, SM_D=D, SM_MW=tiles)
            self.shared.launch(k, (T, -(-H // (16 * tiles))), (64 * tiles,),
                               self._sparse_args(q, tables, positions, ids, sinks, out, spec, H), shared_mem=smem)
        return out

    def _sparse_args(self, q, tables, positions, ids, sinks, out, spec, n: int) -> tuple:
        """sparse_decode's and sparse_prefill's arguments; `n` the one they differ in (sparse_decode's d,
        sparse_prefill's head count: its d is compiled in)."""
        kv, D = self.shared.kv_cache[spec.layer, 0], q.shape[2]
        return (self.cp.ascontiguousarray(q, np.float32), kv, tables, positions, np.uint64(0) if ids is None else ids,
                sinks, out, np.int32(tables.shape[1]), np.int32(BLOCK_SIZE), np.int32(kv.shape[-1]), np.int32(n),
                np.int32(spec.window), np.int32(spec.rate), np.int32(0 if ids is None else ids.shape[1]),
                np.int32(entry_columns(spec)[0]), np.float32(D ** -0.5))


def step_rows(ctx, spec, cp):
    """Per token row of the step (ctx's device arrays; row t of a one-query step is sequence t): its sequence's block
    table [T, blocks], state slot, first position in the step, and its position where the ring keeps its inputs
    (each sequence's last ring_len positions of the step), -1 elsewhere. Gathers on the device: no host reads; the
    layer-independent ones once a step (ctx.dsv4)."""
    positions = ctx.positions
    if ctx.batch is None or ctx.decode_only:
        return ctx.block_tables, ctx.state_slots, positions, positions
    if ctx.dsv4 is None:
        seq, cu = ctx.token_seq, ctx.cu_seqlens
        ctx.dsv4 = (ctx.block_tables[seq], ctx.state_slots[seq], positions[cu[:-1]][seq], positions[cu[1:] - 1][seq])
    tables, ring_slots, starts, last = ctx.dsv4
    kept = cp.where(positions > last - np.int32(spec.ring_len), positions, np.int32(-1)) if spec.rate else None
    return tables, ring_slots, starts, kept


def device_attention(x, w, spec, ctx, p: GpuDSV4Ops):
    """dsv4_attention of a step from its device arrays alone (ctx.positions, slot_mapping, token_seq, state_slots,
    cu_seqlens, block_tables; positions -1 are padding rows): every token's K row written, the windows its tokens
    close compressed (compress_close: a window's inputs from the step's rows at or after its sequence's first
    position in the step, from its ring before), each sequence's last ring_len inputs kept in its ring, the
    indexer's top-k per token (CSA), then one sparse_decode over every row at its own position: a query sees its
    window and the entries closed at or before it, so the step's later rows and entries, already written, stay
    unseen (causal by position). Decode steps (one query a sequence) have fixed shapes for a given number of rows
    and no host reads, so a decode graph holds them; a longer step's only host read is its longest context (the
    indexer's stride)."""
    positions = ctx.positions
    q, kv, inputs, iq, iw = project(x, w, spec, positions, p)
    p.store_rows(spec.layer, ctx.slot_mapping, kv)
    tables, ring_slots, starts, kept = step_rows(ctx, spec, p.cp)
    ids = None
    if spec.rate:
        p.compress_windows(positions, ctx.slot_mapping, starts, ring_slots, inputs, w, spec)
        p.store_ring(spec, ring_slots, kept, inputs)
        if spec.index_heads:
            longest = tables.shape[1] * BLOCK_SIZE if ctx.batch is None else int(ctx.batch.context_lens.max())
            ids = p.indexer_ids(tables, iq, iw, positions, spec, -(-longest // spec.rate))
    out = p.sparse_decode(q, tables, positions, ids, p.fp32(w[f"layers.{spec.layer}.sinks"]), spec)
    return out_projection(out, positions, w, spec, p)
