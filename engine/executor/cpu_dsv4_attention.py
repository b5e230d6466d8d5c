"""DeepSeek-V4 attention in numpy (float32) over the compact cache: a paged row per token and layer
(DSV4AttentionSpec.row_width values: [K = V (roped) | the entry of the window it closes | that window's indexer
key]) and a compressor ring per sequence (a state slot: each compressed layer's last ring_len tokens' compressor
inputs, ring_width values each: [compressor kv | gate | indexer kv | gate]).

A step writes its tokens' K rows (write_rows; a slot -1, a replayed position, is not written); a token that closes
a window of m tokens (position + 1 a multiple of m) then computes that window's entry once from its compressor
inputs, the step's own rows for positions in the step and the ring for earlier ones (close_entries: softmax over
the window's slots of gate + the learned position bias, the weighted sum of the kv, RMSNorm, rope at the window's
first position; CSA's entry w also takes window w - 1's first series), and the indexer's key the same way, and
stores both in its own row (entry_columns); after the step the ring keeps each sequence's last ring_len tokens
(ring_store). Per sequence (its one-query sequences together, padded to the group's longest with zero rows no
query sees) each query attends to its sliding window of K = V rows (group_keys) and to the stored entries it may
see (group_entries), both read from the pool by position (rows_at: window + queries - 1 rows and one per closed
window, not the whole context): a closed window (w < (position + 1) // m) and, on CSA layers, one the lightning
indexer ranks in its top index_topk (sum over indexer heads of weight · relu(q · k); among equal scores, as the
entries whose every head's q · k is negative all score 0, the lower entry first). No entry is rebuilt: a prefix
hit restores the K rows and the entries closed in its blocks, and the sequence replays the tokens of the windows
still open there (DeepseekV4ForCausalLM.replay_tokens): their slots are -1, so they write no row and close no
window, but their compressor inputs reach the windows they open and the ring. Transformers' no-cache forward is
this computation over the whole sequence, which is what the gate checks on every path (its torch.topk leaves the
order of equal scores unspecified: the oracles hold it to this rule, harness/dsv4_oracle.py).

The algorithm (dsv4_attention) is written once over an executor's primitives (DSV4Primitives): numpy here
(NumpyDSV4Ops, the numpy executor's DeepSeek-V4 part, ops.dsv4), CuPy and the bf16 GEMM on the GPU
(engine/executor/gpu_dsv4_ops.py).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.executor.cpu_dsv4_ops import (argsort_stable, grouped_linear, hash_route, hc_merge, hyper_connection,
                                          hyper_head, rms, rope_trailing, sink_attention, swiglu_limited, xp_of)
from memory.kv_pool import BLOCK_SIZE

CONTEXT_ROWS_PER_GROUP = 1 << 15     # padded context rows attended together (~0.4 GB float32 at V4-Flash's width)
# query-key pairs a prompt's query chunk attends at once: its scores [Q, heads, keys] float32 are pairs · heads · 4
# bytes (V4-Flash's 64 heads: 256 MiB; sink_attention holds ~4 such), whatever the step's prompt length
QUERY_KEY_PAIRS = 1 << 20
NO_ROPE = np.zeros(0, np.float32)   # norm_rope's inverse frequencies where a row is normed only (the q LoRA's)


def cos_sin(positions, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, R/2] of positions [T] (numpy or CuPy) times the host table inv_freq [R/2]."""
    xp = xp_of(positions)
    angles = positions.astype(np.float32)[:, None] * xp.asarray(inv_freq, dtype=np.float32)[None, :]
    return xp.cos(angles).astype(np.float32), xp.sin(angles).astype(np.float32)


def compress_windows(rows, prev, have_prev, first, ape, norm, rate: int, overlap: bool, inv_freq, eps: float):
    """The entries [N, d] of N closing windows from their compressor kv | gate columns rows [N, rate, 2·s·d]
    (s = 2 with overlap: the first series feeds the next window's entry, the second its own) and, with overlap,
    the previous window's prev [N, rate, 2·s·d] (have_prev [N]: False for window 0, which has none); first [N]:
    each window's first position (its entry's rope)."""
    xp = xp_of(rows)
    sd = rows.shape[-1] // 2
    d = sd // (2 if overlap else 1)
    kv, gate = rows[..., :sd], rows[..., sd:] + ape
    if overlap:
        prev_gate = xp.where(have_prev[:, None, None], prev[..., sd:sd + d] + ape[:, :d], np.float32(-np.inf))
        kv = xp.concatenate([prev[..., :d] * have_prev[:, None, None], kv[..., d:]], axis=1)
        gate = xp.concatenate([prev_gate, gate[..., d:]], axis=1)
    p = xp.exp(gate - gate.max(axis=1, keepdims=True))
    entries = rms((kv * (p / p.sum(axis=1, keepdims=True))).sum(axis=1), eps, norm)          # [N, d]
    cos, sin = cos_sin(first, inv_freq)
    return rope_trailing(entries[:, None], cos, sin)[:, 0]


def indexer_pick(q: np.ndarray, weights: np.ndarray, keys: np.ndarray, positions: np.ndarray, rate: int,
                 topk: int) -> np.ndarray:
    """visible [B, Q, n]: for each query the closed entries among its top `topk` by the indexer's score
    (q [B, Q, heads, d], weights [B, Q, heads], keys [B, n, d], positions [B, Q]), equal scores the lower entry
    first (a stable sort: the same on every path and executor); all its closed entries when it has at most
    topk."""
    xp = xp_of(q)
    score = xp.einsum("bqh,bqhn->bqn", weights, xp.maximum(xp.einsum("bqhd,bnd->bqhn", q, keys), np.float32(0)))
    score = score * np.float32(keys.shape[-1] ** -0.5)
    closed = xp.arange(keys.shape[1])[None, None, :] < ((positions + 1) // rate)[:, :, None]
    score = xp.where(closed, score, np.float32(-np.inf))
    order = argsort_stable(np.float32(0) - score)[..., :topk]   # 0 - s: no -0.0 (a radix sort would order it apart)
    B, Q = order.shape[:2]
    picked = xp.zeros_like(closed)
    picked[xp.arange(B)[:, None, None], xp.arange(Q)[None, :, None], order] = True
    return picked & closed


def entry_columns(spec) -> tuple[int, int]:
    """Where a closed window's entry and its indexer key sit in the row of the window's last token."""
    return spec.head_dim, 2 * spec.head_dim


def window_inputs(inputs, at: np.ndarray, seq: np.ndarray, first_row: np.ndarray, start: np.ndarray,
                  ring_slots: np.ndarray, spec, p: "DSV4Primitives"):
    """The compressor inputs [N, R, ring_width] at positions at [N, R] (host; -1: zeros) of the group's sequences
    seq [N]: the step's own rows inputs [T, ring_width] for a position at or after its sequence's start in the step
    (from its first row there, first_row), the ring of its state slot (ring_slots) before it."""
    begin = start[seq][:, None]
    in_step = at >= begin
    rows = p.dev(np.where(in_step, first_row[seq][:, None] + at - begin, 0))
    if in_step.all():
        return inputs[rows]
    ring = p.ring_rows(spec, ring_slots[seq], np.where(in_step, -1, at))
    return xp_of(inputs).where(p.dev(in_step)[..., None], inputs[rows], ring)


def close_entries(slots, pos: np.ndarray, w, spec, inputs, first_row: np.ndarray, start: np.ndarray,
                  ring_slots: np.ndarray, p: "DSV4Primitives") -> None:
    """The entries (and indexer keys) of the windows this step's tokens close (position + 1 a multiple of the
    rate), computed once from the window's compressor inputs (and, CSA, the previous window's: window_inputs) and
    stored in the closing token's row (entry_columns). slots, pos: the group's KV slots and positions [G, Q] on
    the host, -1 for padding (a slot -1, a replayed position, closes no window: its entry is stored); inputs
    [T, ring_width]: the step's compressor inputs; first_row, start, ring_slots [G]: each sequence's first row and
    position in the step and its state slot."""
    g, q = np.nonzero((slots >= 0) & (pos >= 0) & ((pos + 1) % spec.rate == 0))
    if not len(g):
        return
    L, D, m, f32 = f"layers.{spec.layer}.", spec.head_dim, spec.rate, p.fp32
    first = pos[g, q] + 1 - m
    at = first[:, None] + np.arange(m)[None, :]                                      # [N, m]
    seqs = (g, np.asarray(first_row), np.asarray(start), np.asarray(ring_slots), spec, p)
    window = window_inputs(inputs, at, *seqs)
    prev = window_inputs(inputs, np.where(at >= m, at - m, -1), *seqs) if spec.overlap else window
    have_prev, first_d, cols, o = p.dev(first > 0), p.dev(first), entry_columns(spec), 2 * spec.series * D
    p.write_rows(spec.layer, slots[g, q], compress_windows(
        window[..., :o], prev[..., :o], have_prev, first_d, f32(w[L + "comp_ape"]), f32(w[L + "comp_norm"]), m,
        spec.overlap, spec.compress_inv_freq, spec.rms_eps), cols[0])
    if spec.index_heads:
        p.write_rows(spec.layer, slots[g, q], compress_windows(
            window[..., o:], prev[..., o:], have_prev, first_d, f32(w[L + "idx_comp_ape"]),
            f32(w[L + "idx_comp_norm"]), m, True, spec.compress_inv_freq, spec.rms_eps), cols[1])


def ring_positions(positions: np.ndarray, cu: np.ndarray, ring_len: int) -> np.ndarray:
    """The step's positions [T] (host) the ring keeps, each sequence's last min(n, ring_len); -1 elsewhere."""
    q_lens = np.diff(cu)
    ends = np.repeat(positions[cu[:-1]] + q_lens, q_lens)
    return np.where(positions >= ends - ring_len, positions, -1)


def group_keys(tables, pos: np.ndarray, ctx_lens: np.ndarray, spec, p: "DSV4Primitives"):
    """(keys [G, Q + window - 1, D], their positions [G, Q + window - 1], -1 where none): the K = V rows the
    group's queries (positions pos [G, Q], -1 padding) may see in their sliding windows, read from the pool."""
    first = np.where(pos >= 0, pos, np.iinfo(np.int32).max).min(axis=1)             # each sequence's first query
    span = first[:, None] - spec.window + 1 + np.arange(pos.shape[1] + spec.window - 1)[None, :]
    span = np.where((span >= 0) & (span < ctx_lens[:, None]), span, -1)
    return p.rows_at(spec.layer, tables, span, 0, spec.head_dim), span


def entry_rows(ctx_lens: np.ndarray, rate: int) -> np.ndarray:
    """The positions [G, n] of the rows holding the closed windows' entries of G contexts (n: the longest's
    count; -1 past a sequence's own)."""
    at = (np.arange(int(ctx_lens.max()) // rate)[None, :] + 1) * rate - 1
    return np.where(at < ctx_lens[:, None], at, -1)


def group_entries(tables, ctx_lens: np.ndarray, spec, p: "DSV4Primitives"):
    """The stored entries [G, n, D] of the closed windows of the group's contexts (zeros past a sequence's own)."""
    return p.rows_at(spec.layer, tables, entry_rows(ctx_lens, spec.rate), entry_columns(spec)[0], spec.head_dim)


def indexer_visible(tables, ctx_lens: np.ndarray, pos: np.ndarray, q, weights, spec, p: "DSV4Primitives"):
    """visible [G, Q, n] (indexer_pick) of the group's queries (q [G, Q, heads, d], weights [G, Q, heads], host
    positions pos [G, Q], -1 padding) over their stored indexer keys, read from the pool."""
    keys = p.rows_at(spec.layer, tables, entry_rows(ctx_lens, spec.rate), entry_columns(spec)[1], spec.index_dim)
    return indexer_pick(q, weights, keys, p.dev(pos), spec.rate, spec.index_topk)


def slots_at(tables: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The KV slots [G, R] of positions at [G, R] (-1: the first block's first slot) of G sequences whose blocks
    are tables [G, blocks] (host ints)."""
    at = np.maximum(at, 0)
    return np.take_along_axis(np.asarray(tables), at // BLOCK_SIZE, axis=1) * BLOCK_SIZE + at % BLOCK_SIZE


def attention_groups(q_lens: np.ndarray, ctx_lens: np.ndarray, max_rows: int) -> list[list[int]]:
    """The step's sequences in groups attended together (padded to the group's longest context): one-query
    sequences (decode) by context length, as many as fit max_rows padded context rows; each longer one alone."""
    groups, group, longest = [], [], 0
    for i in sorted(np.flatnonzero(q_lens == 1).tolist(), key=lambda i: int(ctx_lens[i])):
        longest = max(longest, int(ctx_lens[i]))
        if group and longest * (len(group) + 1) > max_rows:
            groups.append(group)
            group, longest = [], int(ctx_lens[i])
        group.append(i)
    if group:
        groups.append(group)
    return groups + [[int(i)] for i in np.flatnonzero(q_lens != 1)]


def chunk_queries(ctx_len: int, spec, pairs: int) -> int:
    """The most queries of one sequence attended at once within `pairs` query-key pairs: Q queries see Q + window - 1
    window rows and the context's entries (ctx_len // rate), Q · (Q + window - 1 + entries) <= pairs (at least 1)."""
    keys = spec.window - 1 + (ctx_len // spec.rate if spec.rate else 0)
    return max(1, int((np.sqrt(keys * keys + 4.0 * pairs) - keys) // 2))


def attention_chunks(q_lens: np.ndarray, ctx_lens: np.ndarray, spec) -> list[tuple[list[int], int, int]]:
    """(sequences, first query, queries) attended together: attention_groups' decode groups whole, a longer
    sequence's queries in chunks of chunk_queries (its scores bounded by QUERY_KEY_PAIRS, not by the prompt)."""
    chunks = []
    for group in attention_groups(q_lens, ctx_lens, CONTEXT_ROWS_PER_GROUP):
        n = int(q_lens[group].max())
        step = n if n == 1 else chunk_queries(int(ctx_lens[group[0]]), spec, QUERY_KEY_PAIRS)
        chunks += [(group, q0, min(step, n - q0)) for q0 in range(0, n, step)]
    return chunks


def norm_rope(x, positions, inv_freq, eps: float | None = None, weight=None, inverse: bool = False):
    """x [T, heads, d] float32 RMS-normed per head (eps None: not; weight [d] or None) then roped on its trailing
    2·len(inv_freq) dims at positions [T] (inverse: the rope undone; NO_ROPE: none); a new array
    (DSV4Primitives.norm_rope)."""
    y = x if eps is None else rms(x, eps, weight)
    if not len(inv_freq):
        return y
    cos, sin = cos_sin(positions, inv_freq)
    return rope_trailing(y, cos, -sin if inverse else sin)


def project(x, w, spec, positions, p: "DSV4Primitives"):
    """The step's projections of x [T, H] at positions [T] (where p computes): (q [T, heads, D] roped, its K = V
    rows [T, D] (roped), its compressor inputs [T, ring_width] (the compressor's kv | gate, then the indexer's;
    None on sliding layers), the indexer's queries [T, index heads, d] and weights [T, index heads] (CSA; None
    elsewhere))."""
    L, mm, f32 = f"layers.{spec.layer}.", p.mm, p.fp32
    T, H, D, eps = x.shape[0], spec.num_heads, spec.head_dim, spec.rms_eps
    q_res = p.norm_rope(mm(x, w[L + "wq_a"])[:, None], positions, NO_ROPE, eps, f32(w[L + "q_norm"]))[:, 0]
    q = p.norm_rope(mm(q_res, w[L + "wq_b"]).reshape(T, H, D), positions, spec.inv_freq, eps)
    kv = p.norm_rope(mm(x, w[L + "wkv"])[:, None], positions, spec.inv_freq, eps, f32(w[L + "kv_norm"]))[:, 0]
    inputs, iq, iw = [], None, None
    if spec.rate:
        inputs += [mm(x, w[L + "comp_wkv"]), mm(x, w[L + "comp_wgate"])]
    if spec.index_heads:
        inputs += [mm(x, w[L + "idx_comp_wkv"]), mm(x, w[L + "idx_comp_wgate"])]
        iq = p.norm_rope(mm(q_res, w[L + "idx_wq_b"]).reshape(T, spec.index_heads, spec.index_dim), positions,
                         spec.compress_inv_freq)
        iw = mm(x, w[L + "idx_weights"]) * np.float32(spec.index_heads ** -0.5)
    inputs = xp_of(kv).concatenate(inputs, axis=-1) if inputs else None
    return q, kv, inputs, iq, iw


def out_projection(out, positions, w, spec, p: "DSV4Primitives"):
    """The block's output [T, H] of the attention's out [T, heads, D] at positions [T]: the rope undone, the grouped
    output projection (wo_a per group, wo_b)."""
    L = f"layers.{spec.layer}."
    o = p.norm_rope(out, positions, spec.inv_freq, inverse=True).reshape(out.shape[0], -1)
    return p.block_out(p.mm(p.grouped_linear(o, w[L + "wo_a"], spec.o_groups), w[L + "wo_b"]))


def dsv4_attention(x, w, spec, ctx, p: "DSV4Primitives"):
    """The attention block of DeepSeek-V4 layer spec.layer on x [T, H] (its input norm applied), over an executor's
    primitives p; writes the step's K rows and closed entries and its sequences' compressor rings. Returns the
    output projection's [T, H]."""
    b, L = ctx.batch, f"layers.{spec.layer}."
    T, H, D = x.shape[0], spec.num_heads, spec.head_dim
    step_positions = p.dev(b.positions)
    q, kv, inputs, iq, iw = project(x, w, spec, step_positions, p)
    xp = xp_of(kv)
    p.write_rows(spec.layer, b.slot_mapping, kv)
    sinks, out = p.fp32(w[L + "sinks"]), xp.empty((T, H, D), np.float32)
    cu, ctx_lens, positions = np.asarray(b.cu_seqlens), np.asarray(b.context_lens), np.asarray(b.positions)
    q_lens, ring_slots = np.diff(cu), np.asarray(b.state_slots)
    for group, q0, Q in attention_chunks(q_lens, ctx_lens, spec):
        G, at = len(group), q0 + np.arange(Q)[None, :]
        real = at < q_lens[group][:, None]                                  # [G, Q]: padded queries False
        rows_of = np.where(real, cu[group][:, None] + at, 0)               # the step's token rows
        host_pos = np.where(real, positions[rows_of], -1)                          # [G, Q]
        tok, pos = p.dev(rows_of), p.dev(host_pos)
        # the context up to the chunk's last query: the entries later chunks close are not stored yet
        tables, lens = np.asarray(b.block_tables)[group], np.minimum(ctx_lens[group], host_pos.max(axis=1) + 1)
        if spec.rate:
            p.close_entries(np.where(real, np.asarray(b.slot_mapping)[rows_of], -1), host_pos, w, spec,
                            inputs, cu[group], positions[cu[group]], ring_slots[group])
        keys, key_pos = group_keys(tables, host_pos, lens, spec, p)
        d = pos[:, :, None] - p.dev(key_pos)[:, None, :]
        visible = (d >= 0) & (d < spec.window) & p.dev(key_pos >= 0)[:, None, :]
        if spec.rate:
            entries = group_entries(tables, lens, spec, p)
            if spec.index_heads:
                seen = p.indexer_visible(tables, lens, host_pos, iq[tok], iw[tok], spec)
            else:
                seen = xp.arange(entries.shape[1])[None, None, :] < ((pos + 1) // spec.rate)[:, :, None]
            keys, visible = xp.concatenate([keys, entries], axis=1), xp.concatenate([visible, seen], axis=2)
        res = sink_attention(q[tok], keys, visible, sinks, D ** -0.5)           # [G, Q, H, D]
        out[p.dev(rows_of[real])] = res.reshape(G * Q, H, D)[p.dev(np.flatnonzero(real))]
    if spec.rate:
        p.ring_store(spec, np.repeat(ring_slots, q_lens), ring_positions(positions, cu, spec.ring_len), inputs)
    return out_projection(out, step_positions, w, spec, p)


class DSV4Primitives(Protocol):
    """What dsv4_attention asks of an executor."""

    def mm(self, x, weight):
        """x [T, K] · weightᵀ, float32."""

    def norm_rope(self, x, positions, inv_freq: np.ndarray, eps: float | None = None, weight=None,
                  inverse: bool = False):
        """norm_rope (this module's) of x [T, heads, d] float32 at positions [T] (where p computes; the host table
        inv_freq): x's values may be overwritten (each caller's x is its own fresh array)."""

    def fp32(self, weight):
        """A weight as float32 values."""

    def grouped_linear(self, x, weight, groups: int):
        """cpu_dsv4_ops.grouped_linear: x [T, groups·K], group g times its N rows of weight [groups·N, K]; float32
        [T, groups·N]."""

    def dev(self, host):
        """A host array of the step (positions) where the algorithm computes."""

    def const(self, table):
        """A constant host table (the rope's inverse frequencies) where the algorithm computes, kept there."""

    def write_rows(self, layer: int, slots, rows, col: int = 0) -> None:
        """Store rows [T, w] at the step's KV slots (host ints [T]) of layer, from column col; a slot -1 (padding,
        a replayed position) is not written."""

    def rows_at(self, layer: int, tables, at, col: int, width: int):
        """Values [G, R, width] float32 from column col of the rows at positions at (host ints [G, R], -1: zeros)
        of G sequences whose blocks are tables (host ints [G, blocks])."""

    def ring_rows(self, spec, ring_slots, at):
        """float32 [G, R, ring_width]: the ring's compressor inputs at positions at (host ints [G, R], -1: zeros)
        of G sequences in state slots ring_slots (host ints [G])."""

    def ring_store(self, spec, ring_slots, positions, rows) -> None:
        """Keep rows [T, ring_width] of T tokens at positions (host ints [T], -1: not kept) in the rings of
        their sequences' state slots ring_slots (host ints [T]), at position % ring_len."""

    def close_entries(self, slots, pos, w, spec, inputs, first_row, start, ring_slots) -> None:
        """close_entries(.., self): the entries (and indexer keys) of the windows the step's tokens close."""

    def indexer_visible(self, tables, ctx_lens, pos, q, weights, spec):
        """indexer_visible(.., self): the entries [G, Q, n] each query's indexer picks."""

    def block_out(self, y):
        """The block's output in the executor's activation form."""


class NumpyDSV4Ops:
    """ops.dsv4 of the numpy executor (models/ops.py DSV4Ops): DeepSeek-V4's mechanisms (cpu_dsv4_ops.py) and its
    attention over the paged pool kv and the compressor rings of the state slots (state: name -> float32
    [layers, slots, ring_len, ring_width], memory/state_slots.py host_state; the numpy primitives of
    dsv4_attention)."""

    def __init__(self, kv: np.ndarray, state: dict | None = None):
        self.kv, self.state = kv, state or {}

    def hc_streams(self, x, n: int):
        """The residual streams [T, n, H] of the embedded tokens x [T, H] (n copies)."""
        return np.repeat(np.asarray(x, np.float32)[:, None, :], n, axis=1)

    def hyper_connection(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        return hyper_connection(streams, fn, base, scale, iters, hc_eps, norm_eps)

    def hc_merge(self, block_out, streams, post, comb):
        return hc_merge(block_out, streams, post, comb)

    def hyper_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        return hyper_head(streams, fn, base, np.asarray(scale, np.float32).reshape(-1)[:1], hc_eps, norm_eps)

    def swiglu_limited(self, gate_up, limit):
        return swiglu_limited(gate_up, limit)

    def hash_route(self, x, gate_weight, tid2eid, spec, ctx):
        """hash_route on the step's token ids (RouteSpec: its scale; scores sqrtsoftplus)."""
        return hash_route(x @ gate_weight.T, np.asarray(tid2eid).astype(np.int64), np.asarray(ctx.batch.input_ids),
                          spec.scale)

    def attention(self, x, w, spec, ctx):
        return dsv4_attention(x, w, spec, ctx, self)

    # ---- dsv4_attention's primitives (numpy, float32) ------------------------------------------------------
    def mm(self, x, weight):
        return x @ weight.T

    def norm_rope(self, x, positions, inv_freq, eps=None, weight=None, inverse=False):
        return norm_rope(x, positions, inv_freq, eps, weight, inverse)

    def fp32(self, weight):
        return weight

    def grouped_linear(self, x, weight, groups: int):
        return grouped_linear(x, weight, groups)

    def dev(self, host):
        return np.asarray(host)

    const = dev

    def write_rows(self, layer: int, slots, rows, col: int = 0) -> None:
        slots = np.asarray(slots)
        kept = slots >= 0                               # -1 would index the pool's last slot
        if not kept.all():
            slots, rows = slots[kept], rows[kept]
        self.kv[layer, 0, slots, 0, col:col + rows.shape[1]] = rows

    def rows_at(self, layer: int, tables, at, col: int, width: int):
        rows = self.kv[layer, 0, slots_at(tables, at), 0, col:col + width]
        return np.where((at >= 0)[..., None], rows, np.float32(0))

    def ring_rows(self, spec, ring_slots, at):
        at, ring = np.asarray(at), self.state[spec.ring][spec.ring_index]
        rows = ring[np.asarray(ring_slots)[:, None], np.maximum(at, 0) % spec.ring_len]
        return np.where((at >= 0)[..., None], rows, np.float32(0))

    def ring_store(self, spec, ring_slots, positions, rows) -> None:
        kept = np.asarray(positions) >= 0
        ring = self.state[spec.ring][spec.ring_index]
        ring[np.asarray(ring_slots)[kept], np.asarray(positions)[kept] % spec.ring_len] = rows[kept]

    def close_entries(self, slots, pos, w, spec, inputs, first_row, start, ring_slots) -> None:
        close_entries(slots, pos, w, spec, inputs, first_row, start, ring_slots, self)

    def indexer_visible(self, tables, ctx_lens, pos, q, weights, spec):
        return indexer_visible(tables, ctx_lens, pos, q, weights, spec, self)

    def block_out(self, y):
        return y
