"""DeepSeek-V4's decode attention on the device (dsv4_attention.cu's sparse_decode through GpuDSV4Ops) against the
numpy definition (cpu_dsv4_ops.sink_attention over the keys rows_at reads, as cpu_dsv4_attention.dsv4_attention
gathers them) on random paged pools: sliding, CSA (the indexer's ids, -1 padded) and HCA (every closed entry)
layers, padding rows (position -1), contexts shorter than the window, a row of more keys than sparse_decode's
chunk, at the tiny models' width and V4-Flash's; `groups` runs them with the heads a CTA forced (every ATT_G).
Shared by the host emulation (tests/kernels/test_dsv4_attention_emulated.py) and the device test
(tests/gpu/test_gpu_dsv4_attention.py). Bound: 2e-6 of the output's scale (float32 sums in another order; measured
in the emulation within 3.3e-7)."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
from dsv4_indexer_cases import bf16, f32

from engine.executor.cpu_dsv4_attention import entry_columns
from engine.executor.cpu_dsv4_ops import sink_attention
from memory.kv_pool import BLOCK_SIZE

# (name, heads, head_dim, window, rate, topk (0: every closed entry), positions (-1: a padding row))
CASES = [("tiny_sliding", 4, 32, 6, 0, 0, (0, 3, 40, -1)),
         ("tiny_csa", 4, 32, 6, 4, 3, (2, 9, 57, -1)),
         ("tiny_hca", 4, 32, 6, 8, 0, (6, 7, 63, -1)),
         ("v4_flash_csa", 2, 512, 128, 4, 512, (300, 2050)),
         ("v4_flash_hca", 2, 512, 128, 128, 0, (127, 2050)),
         ("tiny_hca_long", 4, 32, 6, 4, 0, (4400, 1000))]      # 1,106 keys: more than a CTA resolves at once


def random_inputs(heads, head_dim, window, rate, topk, positions, seed):
    rng = np.random.default_rng(seed)
    overlap = topk > 0
    spec = SimpleNamespace(layer=0, num_heads=heads, head_dim=head_dim, window=window, rate=rate, overlap=overlap,
                           series=2 if overlap else 1, index_heads=4 if overlap else 0, index_dim=16)
    pos = np.asarray(positions)
    per_seq = -(-(int(pos.max()) + 1) // BLOCK_SIZE) + 1
    blocks = rng.permutation(len(pos) * per_seq + 2)
    tables = blocks[:len(pos) * per_seq].reshape(len(pos), per_seq).astype(np.int32)
    width = head_dim * (1 + (rate > 0)) + spec.index_dim * overlap      # K = V | entry | indexer key
    pool = bf16(rng.standard_normal((1, 1, len(blocks) * BLOCK_SIZE, 1, width)))
    q = rng.standard_normal((len(pos), heads, head_dim)).astype(np.float32)
    ids = np.full((len(pos), max(topk, 1)), -1, np.int32)
    for t, p in enumerate(pos):
        closed = (p + 1) // rate if rate and p >= 0 else 0
        pick = np.sort(rng.permutation(closed)[:topk])
        ids[t, :len(pick)] = pick
    sinks = rng.standard_normal(heads).astype(np.float32) * 2
    return SimpleNamespace(spec=spec, pool=pool, tables=tables, pos=pos.astype(np.int32), q=q,
                           ids=ids if topk else None, sinks=sinks)


def reference(inp) -> np.ndarray:
    s, rows = inp.spec, f32(inp.pool)[0, 0, :, 0]
    out = np.zeros_like(inp.q)
    for t, p in enumerate(inp.pos):
        if p < 0:
            continue
        table = inp.tables[t]

        def at(a, table=table):
            return table[a // BLOCK_SIZE] * BLOCK_SIZE + a % BLOCK_SIZE
        keys = [rows[at(a), :s.head_dim] for a in range(max(0, p - s.window + 1), p + 1)]
        entries = [] if not s.rate else (inp.ids[t][inp.ids[t] >= 0] if inp.ids is not None
                                         else range((p + 1) // s.rate))
        col = entry_columns(s)[0]
        keys += [rows[at((e + 1) * s.rate - 1), col:col + s.head_dim] for e in entries]
        k = np.stack(keys)
        out[t] = sink_attention(inp.q[t][None], k, np.ones((1, len(k)), bool), inp.sinks, s.head_dim ** -0.5)[0]
    return out


def run_kernel(ops, inp, dev, back) -> np.ndarray:
    """sparse_decode through ops (its kv_cache: the case's pool) on the case's arrays put there by dev."""
    ids = None if inp.ids is None else dev(inp.ids)
    return back(ops.sparse_decode(dev(inp.q), dev(inp.tables), dev(inp.pos), ids, dev(inp.sinks), inp.spec))


@contextmanager
def heads_per_cta(group: int):
    """sparse_decode launched with ATT_G = group (where the case's heads allow it) instead of its own choice."""
    from engine.executor import gpu_dsv4_ops

    chosen = gpu_dsv4_ops.sparse_heads_per_cta
    gpu_dsv4_ops.sparse_heads_per_cta = lambda rows, heads, pieces, num_sms: group if heads % group == 0 else 1
    try:
        yield
    finally:
        gpu_dsv4_ops.sparse_heads_per_cta = chosen


def check(got, want) -> None:
    assert np.abs(got - want).max() <= 2e-6 * max(1.0, float(np.abs(want).max())), np.abs(got - want).max()
