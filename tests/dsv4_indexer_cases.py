"""DeepSeek-V4's lightning indexer on the device (dsv4_indexer.cu through GpuDSV4Ops.indexer_topk) against the numpy definition (cpu_dsv4_attention.indexer_visible, itself held to transformers'
by the gate), on random paged pools: shared by the host emulation (tests/kernels/test_dsv4_indexer_emulated.py)
and the device test (tests/gpu/test_gpu_dsv4_indexer.py). `dev` puts a host array where the ops read it, `back`
brings one back.

Each case has entries whose every head's q · k is negative (score exactly 0, whatever the weights' signs) and
entries that repeat another's key (an equal score): the top-k's edge falls inside such a tie in the real-width
case, so the tie rule (the lower entry first) decides the pick. Checks: the kernel's scores within 1e-5 of the
sum of their terms' magnitudes of float64's (float32 in another order); its ids exactly the top-k of its own
scores by the rule; and its picks those of the numpy indexer, but for entries whose two scores sit within that
tolerance of the k-th (a float32 near-tie the two orders may split either way). Measured in the emulation: scores
within 7e-8 of their terms' magnitudes, the picks all the numpy indexer's; the other tie rule fails the check.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from engine.executor.cpu_dsv4_attention import NumpyDSV4Ops, entry_columns, indexer_visible
from memory.kv_pool import BLOCK_SIZE

RATE = 4
# (name, indexer heads, dim, topk, head_dim, queries per sequence, context lengths): the tiny models' width with
# short contexts (fewer entries than topk, none at all) and a chunk of several queries; V4-Flash's (64 heads of
# 128, top 512, K = V of 512) over contexts of 900 to 1150 entries (the k-th among the zeros)
CASES = [("tiny_decode", 4, 16, 3, 32, 1, (3, 4, 13, 40, 77, 100)),
         ("tiny_chunk", 2, 16, 5, 32, 9, (64, 5)),
         ("v4_flash", 64, 128, 512, 512, 1, (3601, 4003, 4600))]


@dataclass
class IndexerInputs:
    spec: SimpleNamespace
    pool: np.ndarray            # bf16 bits [1, 1, slots, 1, row_width]: the layer's rows
    tables: np.ndarray          # int [G, blocks]
    ctx_lens: np.ndarray        # int [G]
    pos: np.ndarray             # int [G, Q], -1 padding
    q: np.ndarray               # float32 [G, Q, heads, dim]
    weights: np.ndarray         # float32 [G, Q, heads]


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f32(bits) -> np.ndarray:
    return np.asarray(bits).view(ml_dtypes.bfloat16).astype(np.float32)


def random_inputs(heads: int, dim: int, topk: int, head_dim: int, Q: int, lens, seed: int) -> IndexerInputs:
    """G sequences in shuffled blocks of one pool; their last Q positions query (earlier ones -1 when the context
    is shorter). q > 0: an entry whose key is < 0 scores exactly 0; 35% of the entries so, and a tenth repeat
    the key of the entry before them."""
    rng = np.random.default_rng(seed)
    spec = SimpleNamespace(layer=0, head_dim=head_dim, series=2, index_heads=heads, index_dim=dim, index_topk=topk,
                           rate=RATE)
    lens = np.asarray(lens)
    per_seq = -(-int(lens.max()) // BLOCK_SIZE)
    blocks = rng.permutation(len(lens) * per_seq + 3)
    tables = blocks[:len(lens) * per_seq].reshape(len(lens), per_seq)
    width = 2 * head_dim + dim                       # K = V | entry | indexer key
    pool = rng.standard_normal((1, 1, len(blocks) * BLOCK_SIZE, 1, width)).astype(np.float32)
    col = entry_columns(spec)[1]
    for g, n in enumerate(lens):
        last = 0
        for e in range(int(n) // RATE):
            slot = tables[g, ((e + 1) * RATE - 1) // BLOCK_SIZE] * BLOCK_SIZE + ((e + 1) * RATE - 1) % BLOCK_SIZE
            kind = rng.uniform()
            if kind < 0.35:
                pool[0, 0, slot, 0, col:col + dim] = -np.abs(pool[0, 0, slot, 0, col:col + dim])
            elif kind < 0.45 and e:
                pool[0, 0, slot, 0, col:col + dim] = pool[0, 0, last, 0, col:col + dim]
            last = slot
    pos = lens[:, None] - Q + np.arange(Q)[None, :]
    q = np.abs(rng.standard_normal((len(lens), Q, heads, dim))).astype(np.float32)
    w = (rng.standard_normal((len(lens), Q, heads)) * heads ** -0.5).astype(np.float32)
    return IndexerInputs(spec, bf16(pool), tables, lens, np.where(pos >= 0, pos, -1), q, w)


def run_indexer(ops, inp: IndexerInputs, dev, back) -> dict:
    """The kernels' ids, counts and scores over the G·Q query rows (each with its sequence's block table, as
    device_attention hands a prompt's rows over), and the mask [G·Q, n] of the entries the ids pick."""
    ids, counts, scores = ops.indexer_topk(0, *device_rows(inp, dev), inp.spec, int(inp.ctx_lens.max()) // RATE)
    got = {"ids": back(ids), "counts": back(counts), "scores": back(scores)}
    n = got["scores"].shape[1]
    got["visible"] = np.zeros((len(got["ids"]), n + 1), bool)         # column n: where the -1 padding lands
    got["visible"][np.arange(len(got["ids"]))[:, None], np.where(got["ids"] >= 0, got["ids"], n)] = True
    got["visible"] = got["visible"][:, :n]
    return got


def device_rows(inp: IndexerInputs, dev) -> tuple:
    """indexer_topk's per-row arguments of the G·Q query rows: tables [G·Q, blocks], q, weights, positions."""
    Q, rows = inp.pos.shape[1], inp.pos.size
    return (dev(np.repeat(inp.tables, Q, axis=0).astype(np.int32)), dev(inp.q.reshape(rows, *inp.q.shape[2:])),
            dev(inp.weights.reshape(rows, -1)), dev(inp.pos.reshape(-1).astype(np.int32)))


def reference(inp: IndexerInputs) -> dict:
    """The numpy indexer's mask on the pool's values, and float64 scores with their terms' magnitudes."""
    pool = f32(inp.pool)
    visible = indexer_visible(inp.tables, inp.ctx_lens, inp.pos, inp.q, inp.weights, inp.spec, NumpyDSV4Ops(pool))
    at = (np.arange(visible.shape[-1])[None, :] + 1) * RATE - 1
    slots = np.take_along_axis(inp.tables, np.minimum(at // BLOCK_SIZE, inp.tables.shape[1] - 1), 1) * BLOCK_SIZE
    col = entry_columns(inp.spec)[1]
    keys = pool[0, 0, slots + at % BLOCK_SIZE, 0, col:col + inp.spec.index_dim].astype(np.float64)   # [G, n, d]
    dots = np.einsum("gqhd,gnd->gqhn", inp.q.astype(np.float64), keys)
    terms = np.einsum("gqhd,gnd->gqhn", np.abs(inp.q.astype(np.float64)), np.abs(keys))
    scale = inp.spec.index_dim ** -0.5
    score = scale * np.einsum("gqh,gqhn->gqn", inp.weights, np.maximum(dots, 0))
    size = scale * np.einsum("gqh,gqhn->gqn", np.abs(inp.weights), terms)
    return {"visible": visible, "score": score, "size": size}


def top_ids(scores: np.ndarray, topk: int) -> np.ndarray:
    """The top-k of scores [n] by the rule (descending, equal scores the lower entry first), ascending."""
    return np.sort(np.argsort(np.float32(0) - scores, kind="stable")[:topk])


def check(got: dict, want: dict, inp: IndexerInputs) -> None:
    G, Q = inp.pos.shape
    topk, n_max = inp.spec.index_topk, want["visible"].shape[-1]
    closed = np.where(inp.pos >= 0, (inp.pos + 1) // RATE, 0).reshape(-1)
    score, size = want["score"].reshape(G * Q, n_max), want["size"].reshape(G * Q, n_max)
    visible = want["visible"].reshape(G * Q, n_max)
    for r, n in enumerate(closed):
        mine = got["scores"][r, :n]
        assert np.all(np.abs(mine - score[r, :n]) <= 1e-5 * size[r, :n] + 1e-30), (r, "scores")
        ids = top_ids(mine, topk)
        assert got["counts"][r] == len(ids), (r, "count")
        np.testing.assert_array_equal(got["ids"][r], np.concatenate([ids, -np.ones(topk - len(ids), int)]))
        np.testing.assert_array_equal(got["visible"].reshape(G * Q, n_max)[r, :n].nonzero()[0], ids)
        if n > topk:                            # picks that differ: only near-ties of the k-th score
            kth = np.sort(score[r, :n])[::-1][topk - 1]
            differ = np.flatnonzero(np.isin(np.arange(n), ids) != visible[r, :n])
            assert np.all(np.abs(score[r, differ] - kth) <= 2e-5 * size[r, differ] + 1e-30), (r, differ)


def edge_in_a_tie(inp: IndexerInputs, want: dict) -> bool:
    """Whether some row's k-th and (k+1)-th scores are exactly equal (the tie rule decides its pick)."""
    G, Q = inp.pos.shape
    topk = inp.spec.index_topk
    for r, n in enumerate(np.where(inp.pos >= 0, (inp.pos + 1) // RATE, 0).reshape(-1)):
        s = np.sort(want["score"].reshape(G * Q, -1)[r, :n])[::-1]
        if n > topk and s[topk - 1] == s[topk]:
            return True
    return False
