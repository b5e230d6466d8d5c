"""dsv4_indexer.cu (DeepSeek-V4's lightning indexer) on the device through GpuDSV4Ops, against the numpy
indexer: the cases and checks of the host emulation (tests/dsv4_indexer_cases.py), at the tiny models' widths
and DeepSeek-V4-Flash's, plus a replay of the two launches captured in a CUDA graph on new queries."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_indexer_cases import CASES, check, random_inputs, reference, run_indexer
from test_gpu_dsv4_hc import DeviceShared, back

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def ops(inp):
    from engine.executor.gpu_dsv4_ops import GpuDSV4Ops

    o = GpuDSV4Ops(DeviceShared(), None)
    o.shared.kv_cache = cp.asarray(inp.pool)
    return o


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("pdl", [False, True])
def test_indexer_matches_numpy_on_the_device(case, pdl):
    inp = random_inputs(*case[1:], seed=len(case[0]))
    o = ops(inp)
    o.shared.pdl = pdl
    with o.shared.stream:
        got = run_indexer(o, inp, cp.asarray, back)
    check(got, reference(inp), inp)


def test_a_captured_graph_replays_the_indexer():
    """indexer_topk captured once at V4-Flash's width, replayed on new queries and weights written into the
    captured buffers: each replay's ids are the top-k of the numpy indexer's."""
    from engine.executor.gpu_graphs import capture_mode

    inp = random_inputs(*CASES[-1][1:], seed=1)
    o, (G, Q), n = ops(inp), inp.pos.shape, int(inp.ctx_lens.max()) // 4
    tables = cp.asarray(np.repeat(inp.tables, Q, axis=0).astype(np.int32))
    positions = cp.asarray(inp.pos.reshape(-1).astype(np.int32))
    q, w = cp.asarray(inp.q.reshape(G * Q, *inp.q.shape[2:])), cp.asarray(inp.weights.reshape(G * Q, -1))
    with o.shared.stream:
        o.indexer_topk(0, tables, q, w, positions, inp.spec, n)                # compiled, the pool's blocks there
        o.shared.stream.synchronize()
        o.shared.stream.begin_capture(*capture_mode())
        ids, counts, scores = o.indexer_topk(0, tables, q, w, positions, inp.spec, n)
        graph = o.shared.stream.end_capture()
        for seed in (2, 3):
            new = random_inputs(*CASES[-1][1:], seed=seed)
            new.pool, new.tables = inp.pool, inp.tables
            q.set(new.q.reshape(q.shape), o.shared.stream)
            w.set(new.weights.reshape(w.shape), o.shared.stream)
            graph.launch(o.shared.stream)
            want = reference(new)
            got = {"ids": back(ids), "counts": back(counts), "scores": back(scores)}
            got["visible"] = np.zeros((G * Q, n), bool)
            for r in range(G * Q):
                got["visible"][r, got["ids"][r, :got["counts"][r]]] = True
            check(got, want, new)
