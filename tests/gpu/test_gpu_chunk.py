"""paged_chunk.cu's host side (engine/executor/gpu_chunk.py) on the CPU: which sequences it serves, its
tiles and split count, and the whole prefill attention path with numpy stand-ins for the paged, gather,
CuTe and chunk kernels (the chunk kernel's partial rows and merge emulated in its layout) against a
direct numpy attention over the paged cache. The kernel itself on the GPU: tests/gpu/test_gpu_prefill_gpu.py."""
from __future__ import annotations

import types

import numpy as np
import pytest

from engine.executor.gpu_chunk import (CHUNK_ROWS, MAX_CHUNK_SPLITS, ChunkKernel, chunk_fits, chunk_splits,
                                       chunk_tiles)
from engine.executor.gpu_inputs import GpuStepContext
from engine.executor.gpu_prefill import PrefillStep, plan_prefill
from test_gpu_prefill import (PagedStandIn, causal_ref, mixed_batch, numpy_gather, numpy_varlen, spec_for,
                                    token_seqs)

# Short runs over long contexts (a 16-token prefix hit at 3k, 3 tokens at 70, 63 tokens at 2k, a 2-token
# run inside one block) between decodes and a long prompt (also the GPU test's step, test_gpu_prefill_gpu.py).
SHORT_RUNS = [(499, 1), (3000, 16), (0, 300), (70, 3), (2047, 63), (5, 2), (900, 1)]


def test_chunk_fits_its_shapes():
    assert chunk_fits(4, 128) and chunk_fits(1, 64) and chunk_fits(16, 16) and chunk_fits(64, 128)
    assert not chunk_fits(3, 128) and not chunk_fits(4, 256) and not chunk_fits(4, 72) and not chunk_fits(128, 64)


def test_tiles_cover_each_served_run_in_order():
    cu = np.array([0, 1, 17, 317, 320], np.int32)
    tiles = chunk_tiles(cu, np.array([False, True, False, True]), 16)
    assert tiles.tolist() == [[1, 16], [317, 3]]
    tiles = chunk_tiles(cu, np.array([False, True, True, False]), 64)
    assert tiles.tolist() == [[1, 16], [17, 64], [81, 64], [145, 64], [209, 64], [273, 44]]
    assert chunk_tiles(cu, np.zeros(4, bool), 16).shape == (0, 2)


def test_splits_fill_the_gpu_within_the_partials():
    # one 16-token hit at 16k on 8 KV heads: as many splits as one wave of 3 CTAs per SM holds
    assert chunk_splits(1, 16, 8, 16384, 8192 + 264, 132) == 3 * 132 // 8 == 49
    assert chunk_splits(1, 16, 1, 16384, 8192 + 264, 132) == MAX_CHUNK_SPLITS
    assert chunk_splits(1, 16, 8, 300, 8456, 132) == 2              # no split under 256 keys
    assert chunk_splits(1, 16, 8, 100, 8456, 132) == 1
    assert chunk_splits(200, 16, 8, 16384, 8456, 132) == 1           # the grid is full already
    assert chunk_splits(10, 16, 1, 16384, 500, 132) == 3            # partial rows: 10 · 16 · S <= 500


def test_plan_sends_short_runs_to_the_chunk_kernel():
    b = mixed_batch(np.random.default_rng(1), SHORT_RUNS)
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, 64, 8192, chunk_tokens=16)
    assert [a.num_seqs for a in plan.launches] == [1]                         # the 300-token prompt
    tiles = plan.data[plan.chunk_work:plan.chunk_work + 2 * plan.chunk_tiles].reshape(-1, 2)
    cu = b.cu_seqlens
    assert tiles.tolist() == [[cu[1], 16], [cu[3], 3], [cu[4], 16], [cu[4] + 16, 16], [cu[4] + 32, 16],
                              [cu[4] + 48, 15], [cu[5], 2]]
    assert plan.chunk_context == 3016
    paged = plan.data[plan.paged_positions:plan.paged_positions + b.num_tokens]
    assert np.flatnonzero(paged >= 0).tolist() == [0, b.num_tokens - 1]       # the two decodes only
    assert plan.paged_context == 901
    # off: the short runs stay paged; with only short runs and decodes there is still a plan
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, 64, 8192)
    assert plan.chunk_tiles == 0
    only = mixed_batch(np.random.default_rng(2), [(499, 1), (16000, 16)])
    assert plan_prefill(only.cu_seqlens, only.context_lens, only.positions, 64, 8192) is None
    plan = plan_prefill(only.cu_seqlens, only.context_lens, only.positions, 64, 8192, chunk_tokens=16)
    assert plan.launches == [] and plan.chunk_tiles == 1 and plan.paged_rows == (0, 1)


def numpy_chunk(ops, kernel, grid, args):
    """paged_chunk.cu's two entries in numpy, in its layout: split s of a tile's context, partial rows
    ((tile · QT + j) · Hq + h) · S + s, max in log2 units; the merge over the splits that saw a key."""
    G = kernel.group
    QT = CHUNK_ROWS // G
    if kernel.name == "attend":
        q, kc, vc, tables, width, token_seq, positions, tiles, po, pm, ps, out, Hkv, scale = args
        n_tiles, S, Hkv = grid
        Hq, D = Hkv * G, q.shape[-1]
        for i in range(n_tiles):
            t0, n = tiles[2 * i], tiles[2 * i + 1]
            ctx = int(positions[t0:t0 + n].max()) + 1
            per = -(-(-(-ctx // S)) // 32) * 32
            for s in range(S):
                lo, hi = s * per, min(ctx, (s + 1) * per)
                for j in range(n):
                    t = t0 + j
                    p = np.arange(lo, max(lo, min(hi, positions[t] + 1)))
                    sl = tables[token_seq[t0]][p // 16] * 16 + p % 16
                    for h in range(Hq):
                        sc = kc[sl, h // G] @ q[t, h] * scale * np.log2(np.e)
                        m = sc.max() if p.size else -np.inf
                        w = np.exp2(sc - m) if p.size else np.zeros(0)
                        acc, lsum = w @ vc[sl, h // G] if p.size else np.zeros(D), w.sum()
                        if S == 1:
                            out[t, h * D:(h + 1) * D] = acc / lsum
                        else:
                            r = ((i * QT + j) * Hq + h) * S + s
                            po[r * D:(r + 1) * D], pm[r], ps[r] = acc, m, lsum
        return
    tiles, po, pm, ps, out, Hkv, S = args
    assert grid[0] % QT == 0 and grid[1] == Hkv * G
    Hq, D = grid[1], out.shape[1] // grid[1]
    for i in range(grid[0] // QT):
        t0, n = tiles[2 * i], tiles[2 * i + 1]
        for j in range(n):
            for h in range(Hq):
                r = ((i * QT + j) * Hq + h) * S + np.arange(S)
                ok = ps[r] > 0
                m = pm[r][ok].max()
                wt = np.exp2(pm[r][ok] - m)
                acc = (po.reshape(-1, D)[r][ok] * wt[:, None]).sum(0)
                out[t0 + j, h * D:(h + 1) * D] = acc / (ps[r][ok] * wt).sum()


@pytest.mark.parametrize("min_query,Hq,Hkv,capacity", [(64, 4, 2, 4096), (64, 8, 1, 4096), (1000, 4, 2, 4096),
                                                      (64, 4, 2, 0)])
def test_prefill_path_with_the_chunk_kernel(monkeypatch, min_query, Hq, Hkv, capacity):
    """The step's rows: decodes on the paged kernel, the 300-token prompt on CuTe (or the chunk kernel at
    min_query 1000), the short runs on the chunk kernel, split (or at capacity 0: one split, direct
    writes); every row equals the direct attention."""
    import openinfer_kernels.cute as cute

    rng = np.random.default_rng(min_query + Hq + capacity)
    b = mixed_batch(rng, SHORT_RUNS)
    D, G, T = 64, Hq // Hkv, b.num_tokens
    slots = (int(b.block_tables.max()) + 1) * 16
    kv = rng.standard_normal((1, 2, slots, Hkv, D)).astype(np.float32)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    ops = PagedStandIn(kv, b, G)
    ops.shared.max_tokens, ops.shared.num_sms = capacity, 132
    ops.part_out, ops.part_max, ops.part_sum = (np.full(s, np.nan, np.float32) for s in
                                                ((capacity + 264) * Hq * D, (capacity + 264) * Hq, (capacity + 264) * Hq))
    chunk = ChunkKernel.__new__(ChunkKernel)
    chunk.group, chunk.head_dim, chunk.stream, chunk.tokens, chunk.launches = G, D, None, CHUNK_ROWS // G, 0
    chunk.attend = types.SimpleNamespace(name="attend", group=G)
    chunk.merge = types.SimpleNamespace(name="merge", group=G)
    seen = []

    def fake_launch(kernel, grid, block, args, stream):
        if kernel == "kv_gather":
            return numpy_gather(kernel, grid, block, args, stream)
        seen.append((kernel.name, grid))
        return numpy_chunk(ops, kernel, grid, args)

    for module in ("gpu_prefill", "gpu_chunk"):          # the launches of both parts
        monkeypatch.setattr(f"engine.executor.{module}.launch", fake_launch)
    monkeypatch.setattr(cute, "varlen_attention", numpy_varlen)
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, min_query, 8192, chunk.tokens)
    own = types.SimpleNamespace(data=plan.data, stream=None, gather="kv_gather", launches=0, chunk=chunk,
                                k=np.full((8192, Hkv, D), np.nan, np.float32), v=np.full((8192, Hkv, D), np.nan, np.float32))
    ctx = GpuStepContext(num_tokens=T, input_ids=b.input_ids, positions=b.positions, slot_mapping=b.slot_mapping,
                         token_seq=token_seqs(b), block_tables=b.block_tables, sample_rows=None, num_splits=1,
                         prefill=PrefillStep(own, plan))
    out = ops.attention(q, spec_for(D, Hq, Hkv), ctx)
    assert chunk.launches == 1 and own.launches == (1 if min_query == 64 else 0)
    S = seen[0][1][1]
    assert seen[0][0] == "attend" and (S == 1) == (capacity == 0) and len(seen) == (1 if S == 1 else 2)
    np.testing.assert_allclose(out, causal_ref(q, kv[0, 0], kv[0, 1], b, G), atol=1e-5, rtol=1e-5)


def test_a_layer_the_chunk_kernel_does_not_fit_goes_paged():
    b = mixed_batch(np.random.default_rng(3), [(499, 1), (3000, 16)])
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, 64, 8192, chunk_tokens=16)
    chunk = types.SimpleNamespace(group=4, head_dim=128)
    step = PrefillStep(types.SimpleNamespace(chunk=chunk), plan)
    assert step.serves(spec_for(128, 8, 2))
    assert not step.serves(spec_for(64, 8, 2)) and not step.serves(spec_for(128, 8, 1))
