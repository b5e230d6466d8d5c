"""DeepSeek-V4 attention in numpy (float32) over the paged pool, one row per token and layer (DSV4AttentionSpec
.row_width values: [K = V (roped) | compressor kv | compressor gate | indexer kv | indexer gate]).

A step writes its tokens' rows, then per sequence builds the compressed entries of every closed window of its
context from the stored compressor inputs (compress_entries: softmax over each window's slots of gate + the
learned position bias, the weighted sum of the kv, RMSNorm, rope at the window's first position; CSA's entry w
also takes window w - 1's first series), and each query attends to its sliding window of K = V rows and to the
compressed entries it may see: a closed window (w < (position + 1) // m) and, on CSA layers, one the lightning
indexer ranks in its top index_topk (sum over indexer heads of weight · relu(q · k)). Transformers' no-cache
forward is this computation over the whole sequence, which is what the gate checks on every path.
"""
from __future__ import annotations

import numpy as np

from engine.executor.cpu_dsv4_ops import grouped_linear, rms, rope_trailing, sink_attention
from memory.kv_pool import BLOCK_SIZE, block_view


def cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angles = np.asarray(positions, np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def compress_entries(kv: np.ndarray, gate: np.ndarray, ape: np.ndarray, norm: np.ndarray, rate: int, overlap: bool,
                     inv_freq: np.ndarray, eps: float) -> np.ndarray:
    """The entries [n, d] of the n = len(kv) // rate closed windows from each token's compressor kv / gate
    [L, s·d] (s = 2 with overlap: the first series feeds the next window's entry, the second its own)."""
    n = len(kv) // rate
    d = kv.shape[1] // (2 if overlap else 1)
    if n == 0:
        return np.zeros((0, d), np.float32)
    kv = kv[:n * rate].reshape(n, rate, -1)
    gate = gate[:n * rate].reshape(n, rate, -1) + ape
    if overlap:
        prev_kv, prev_gate = np.zeros((n, rate, d), np.float32), np.full((n, rate, d), -np.inf, np.float32)
        prev_kv[1:], prev_gate[1:] = kv[:-1, :, :d], gate[:-1, :, :d]
        kv = np.concatenate([prev_kv, kv[..., d:]], axis=1)
        gate = np.concatenate([prev_gate, gate[..., d:]], axis=1)
    p = np.exp(gate - gate.max(axis=1, keepdims=True))
    entries = rms((kv * (p / p.sum(axis=1, keepdims=True))).sum(axis=1), eps, norm)
    cos, sin = cos_sin(np.arange(n) * rate, inv_freq)
    return rope_trailing(entries[:, None], cos, sin)[:, 0]


def indexer_pick(q: np.ndarray, weights: np.ndarray, keys: np.ndarray, positions: np.ndarray, rate: int,
                 topk: int) -> np.ndarray:
    """visible [n_q, n]: for each query the closed entries among its top `topk` by the indexer's score
    (q [n_q, heads, d], weights [n_q, heads], keys [n, d]); all its closed entries when it has at most topk."""
    score = np.einsum("qh,qhn->qn", weights, np.maximum(np.einsum("qhd,nd->qhn", q, keys), 0)) * keys.shape[1] ** -0.5
    closed = np.arange(len(keys))[None, :] < ((positions + 1) // rate)[:, None]
    score = np.where(closed, score, -np.inf)
    order = np.argsort(-score, axis=-1, kind="stable")[:, :topk]
    picked = np.zeros_like(closed)
    np.put_along_axis(picked, order, True, axis=-1)
    return picked & closed


class NumpyDSV4AttentionOps:
    """Mixed into NumpyOps (which provides self.kv)."""

    def dsv4_attention(self, x, w, spec, ctx):
        """The attention block of DeepSeek-V4 layer spec.layer on x [T, H] (its input norm applied); writes the
        step's rows. Returns the output projection's [T, H]."""
        b, L = ctx.batch, f"layers.{spec.layer}."
        T, H, D, eps = x.shape[0], spec.num_heads, spec.head_dim, spec.rms_eps
        cos, sin = cos_sin(b.positions, spec.inv_freq)
        q_res = rms(x @ w[L + "wq_a"].T, eps, w[L + "q_norm"])
        q = rope_trailing(rms((q_res @ w[L + "wq_b"].T).reshape(T, H, D), eps), cos, sin)
        kv = rope_trailing(rms(x @ w[L + "wkv"].T, eps, w[L + "kv_norm"])[:, None], cos, sin)[:, 0]
        row = [kv]
        if spec.rate:
            row += [x @ w[L + "comp_wkv"].T, x @ w[L + "comp_wgate"].T]
        if spec.index_heads:
            row += [x @ w[L + "idx_comp_wkv"].T, x @ w[L + "idx_comp_wgate"].T]
            iq = rope_trailing((q_res @ w[L + "idx_wq_b"].T).reshape(T, spec.index_heads, spec.index_dim),
                               *cos_sin(b.positions, spec.compress_inv_freq))
            iw = (x @ w[L + "idx_weights"].T) * np.float32(spec.index_heads ** -0.5)
        row = np.concatenate(row, axis=-1)
        self.kv[spec.layer, 0, b.slot_mapping, 0, :row.shape[1]] = row
        cache = block_view(self.kv[spec.layer, 0])
        out = np.empty((T, H, D), np.float32)
        for i in range(len(b.seqs)):
            q0, q1, n_ctx = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1]), int(b.context_lens[i])
            rows = cache[b.block_tables[i, :-(-n_ctx // BLOCK_SIZE)]].reshape(-1, cache.shape[-1])[:n_ctx]
            pos = b.positions[q0:q1]
            d = pos[:, None] - np.arange(n_ctx)[None, :]
            keys, visible = rows[:, :D], (d >= 0) & (d < spec.window)
            if spec.rate:
                s = spec.series * D
                entries = compress_entries(rows[:, D:D + s], rows[:, D + s:D + 2 * s], w[L + "comp_ape"],
                                           w[L + "comp_norm"], spec.rate, spec.overlap, spec.compress_inv_freq, eps)
                if spec.index_heads:
                    o, di = D + 2 * s, 2 * spec.index_dim
                    ikeys = compress_entries(rows[:, o:o + di], rows[:, o + di:o + 2 * di], w[L + "idx_comp_ape"],
                                             w[L + "idx_comp_norm"], spec.rate, True, spec.compress_inv_freq, eps)
                    seen = indexer_pick(iq[q0:q1], iw[q0:q1], ikeys, pos, spec.rate, spec.index_topk)
                else:
                    seen = np.arange(len(entries))[None, :] < ((pos + 1) // spec.rate)[:, None]
                keys, visible = np.concatenate([keys, entries]), np.concatenate([visible, seen], axis=1)
            out[q0:q1] = sink_attention(q[q0:q1], keys, visible, w[L + "sinks"], D ** -0.5)
        o = rope_trailing(out, cos, -sin).reshape(T, H * D)
        return grouped_linear(o, w[L + "wo_a"], spec.o_groups) @ w[L + "wo_b"].T
