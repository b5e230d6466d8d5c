"""DeepSeek-V4 attention in numpy (float32) over the paged pool, one row per token and layer (DSV4AttentionSpec
.row_width values: [K = V (roped) | compressor kv | compressor gate | indexer kv | indexer gate]).

A step writes its tokens' rows, then per sequence (its one-query sequences together, each context padded to
the group's longest with zero rows no query sees) builds the compressed entries of every closed window of its
context from the stored compressor inputs (compress_entries: softmax over each window's slots of gate + the
learned position bias, the weighted sum of the kv, RMSNorm, rope at the window's first position; CSA's entry w
also takes window w - 1's first series), and each query attends to its sliding window of K = V rows and to the
compressed entries it may see: a closed window (w < (position + 1) // m) and, on CSA layers, one the lightning
indexer ranks in its top index_topk (sum over indexer heads of weight · relu(q · k); among equal scores, as the
entries whose every head's q · k is negative all score 0, the lower entry first). Transformers' no-cache
forward is this computation over the whole sequence, which is what the gate checks on every path (its
torch.topk leaves the order of equal scores unspecified: the oracles hold it to this rule,
harness/dsv4_oracle.py).

The algorithm (dsv4_attention) is written once over an executor's primitives (DSV4Primitives): numpy here
(NumpyDSV4Ops, the numpy executor's DeepSeek-V4 part, ops.dsv4), CuPy and the bf16 GEMM on the GPU
(engine/executor/gpu_dsv4_ops.py).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.executor.cpu_dsv4_ops import (argsort_stable, grouped_linear, hash_route, hc_merge, hyper_connection,
                                          hyper_head, rms, rope_trailing, sink_attention, swiglu_limited, xp_of)
from memory.kv_pool import BLOCK_SIZE, block_view

CONTEXT_ROWS_PER_GROUP = 1 << 15     # padded context rows attended together (~0.4 GB float32 at V4-Flash's width)


def cos_sin(positions, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, R/2] of positions [T] (numpy or CuPy) times the host table inv_freq [R/2]."""
    xp = xp_of(positions)
    angles = positions.astype(np.float32)[:, None] * xp.asarray(inv_freq, dtype=np.float32)[None, :]
    return xp.cos(angles).astype(np.float32), xp.sin(angles).astype(np.float32)


def compress_entries(kv: np.ndarray, gate: np.ndarray, ape: np.ndarray, norm: np.ndarray, rate: int, overlap: bool,
                     inv_freq: np.ndarray, eps: float) -> np.ndarray:
    """The entries [B, n, d] of the n = L // rate closed windows of each sequence's compressor kv / gate
    [B, L, s·d] (s = 2 with overlap: the first series feeds the next window's entry, the second its own)."""
    xp, B, n = xp_of(kv), kv.shape[0], kv.shape[1] // rate
    d = kv.shape[2] // (2 if overlap else 1)
    if n == 0:
        return xp.zeros((B, 0, d), np.float32)
    kv = kv[:, :n * rate].reshape(B, n, rate, -1)
    gate = gate[:, :n * rate].reshape(B, n, rate, -1) + ape
    if overlap:
        prev_kv, prev_gate = xp.zeros((B, n, rate, d), np.float32), xp.full((B, n, rate, d), -np.inf, np.float32)
        prev_kv[:, 1:], prev_gate[:, 1:] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
        kv = xp.concatenate([prev_kv, kv[..., d:]], axis=2)
        gate = xp.concatenate([prev_gate, gate[..., d:]], axis=2)
    p = xp.exp(gate - gate.max(axis=2, keepdims=True))
    entries = rms((kv * (p / p.sum(axis=2, keepdims=True))).sum(axis=2), eps, norm)          # [B, n, d]
    cos, sin = cos_sin(xp.arange(n, dtype=np.int32) * rate, inv_freq)
    return rope_trailing(entries.transpose(1, 0, 2), cos, sin).transpose(1, 0, 2)


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


def dsv4_attention(x, w, spec, ctx, p: "DSV4Primitives"):
    """The attention block of DeepSeek-V4 layer spec.layer on x [T, H] (its input norm applied), over an executor's
    primitives p; writes the step's rows. Returns the output projection's [T, H]."""
    b, L, mm, f32 = ctx.batch, f"layers.{spec.layer}.", p.mm, p.fp32
    T, H, D, eps = x.shape[0], spec.num_heads, spec.head_dim, spec.rms_eps
    positions = p.dev(b.positions)
    cos, sin = cos_sin(positions, spec.inv_freq)
    q_res = rms(mm(x, w[L + "wq_a"]), eps, f32(w[L + "q_norm"]))
    q = rope_trailing(rms(mm(q_res, w[L + "wq_b"]).reshape(T, H, D), eps), cos, sin)
    kv = rope_trailing(rms(mm(x, w[L + "wkv"]), eps, f32(w[L + "kv_norm"]))[:, None], cos, sin)[:, 0]
    row = [kv]
    if spec.rate:
        row += [mm(x, w[L + "comp_wkv"]), mm(x, w[L + "comp_wgate"])]
    if spec.index_heads:
        row += [mm(x, w[L + "idx_comp_wkv"]), mm(x, w[L + "idx_comp_wgate"])]
        iq = rope_trailing(mm(q_res, w[L + "idx_wq_b"]).reshape(T, spec.index_heads, spec.index_dim),
                           *cos_sin(positions, spec.compress_inv_freq))
        iw = mm(x, w[L + "idx_weights"]) * np.float32(spec.index_heads ** -0.5)
    xp = xp_of(kv)
    p.write_rows(spec.layer, b.slot_mapping, xp.concatenate(row, axis=-1))
    sinks, out = f32(w[L + "sinks"]), xp.empty((T, H, D), np.float32)
    cu, ctx_lens = np.asarray(b.cu_seqlens), np.asarray(b.context_lens)
    q_lens = np.diff(cu)
    for group in attention_groups(q_lens, ctx_lens, CONTEXT_ROWS_PER_GROUP):
        G, Q, n_ctx = len(group), int(q_lens[group].max()), int(ctx_lens[group].max())
        real = np.arange(Q)[None, :] < q_lens[group][:, None]               # [G, Q]: padded queries False
        rows_of = np.where(real, cu[group][:, None] + np.arange(Q)[None, :], 0)   # the step's token rows
        tok, pos = p.dev(rows_of), p.dev(np.where(real, np.asarray(b.positions)[rows_of], -1))
        rows = p.context_rows(spec.layer, b.block_tables[group, :-(-n_ctx // BLOCK_SIZE)],
                              ctx_lens[group], n_ctx)                   # [G, n_ctx, width], zero padded
        d = pos[:, :, None] - xp.arange(n_ctx)[None, None, :]
        keys, visible = rows[..., :D], (d >= 0) & (d < spec.window)
        if spec.rate:
            s = spec.series * D
            entries = compress_entries(rows[..., D:D + s], rows[..., D + s:D + 2 * s], f32(w[L + "comp_ape"]),
                                       f32(w[L + "comp_norm"]), spec.rate, spec.overlap, spec.compress_inv_freq,
                                       eps)
            if spec.index_heads:
                o, di = D + 2 * s, 2 * spec.index_dim
                ikeys = compress_entries(rows[..., o:o + di], rows[..., o + di:o + 2 * di],
                                         f32(w[L + "idx_comp_ape"]), f32(w[L + "idx_comp_norm"]), spec.rate, True,
                                         spec.compress_inv_freq, eps)
                seen = indexer_pick(iq[tok], iw[tok], ikeys, pos, spec.rate, spec.index_topk)
            else:
                seen = xp.arange(entries.shape[1])[None, None, :] < ((pos + 1) // spec.rate)[:, :, None]
            keys, visible = xp.concatenate([keys, entries], axis=1), xp.concatenate([visible, seen], axis=2)
        res = sink_attention(q[tok], keys, visible, sinks, D ** -0.5)           # [G, Q, H, D]
        out[p.dev(rows_of[real])] = res.reshape(G * Q, H, D)[p.dev(np.flatnonzero(real))]
    o = rope_trailing(out, cos, -sin).reshape(T, H * D)
    return p.block_out(mm(grouped_linear(o, f32(w[L + "wo_a"]), spec.o_groups), w[L + "wo_b"]))


class DSV4Primitives(Protocol):
    """What dsv4_attention asks of an executor."""

    def mm(self, x, weight):
        """x [T, K] · weightᵀ, float32."""

    def fp32(self, weight):
        """A weight as float32 values."""

    def dev(self, host):
        """A host array of the step (positions) where the algorithm computes."""

    def write_rows(self, layer: int, slots, rows) -> None:
        """Store rows [T, w] at the step's KV slots of layer."""

    def context_rows(self, layer: int, tables, lens, n: int):
        """Rows [G, n, row width] float32 of G sequences: the first lens[g] rows of the blocks tables[g] (host
        ints [G, blocks]), zeros after them."""

    def block_out(self, y):
        """The block's output in the executor's activation form."""


class NumpyDSV4Ops:
    """ops.dsv4 of the numpy executor (models/ops.py DSV4Ops): DeepSeek-V4's mechanisms (cpu_dsv4_ops.py) and its
    attention over the paged pool kv (the numpy primitives of dsv4_attention)."""

    def __init__(self, kv: np.ndarray):
        self.kv = kv

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

    def fp32(self, weight):
        return weight

    def dev(self, host):
        return np.asarray(host)

    def write_rows(self, layer: int, slots, rows) -> None:
        self.kv[layer, 0, slots, 0, :rows.shape[1]] = rows

    def context_rows(self, layer: int, tables, lens, n: int):
        cache = block_view(self.kv[layer, 0])
        rows = cache[tables].reshape(len(tables), -1, cache.shape[-1])[:, :n]
        return np.where((np.arange(n)[None, :] < np.asarray(lens)[:, None])[..., None], rows, np.float32(0))

    def block_out(self, y):
        return y
