"""dsv4_attention.cu (DeepSeek-V4's decode attention) on the device through GpuDSV4Ops, against the numpy
definition: the cases and bound of the host emulation (tests/dsv4_attention_cases.py), with and without PDL, plus
a replay of the launch captured in a CUDA graph on new queries and ids written into the captured buffers."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
from dsv4_attention_cases import CASES, check, heads_per_cta, random_inputs, reference, run_kernel
from test_gpu_dsv4_hc import back
from test_gpu_dsv4_indexer import ops

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


@pytest.mark.parametrize("group", [0, 2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_sparse_decode_matches_numpy_on_the_device(pdl, group):
    """group 0: the heads a CTA sparse_decode chooses; 2 / 4: forced."""
    for name, *shape in CASES:
        inp = random_inputs(*shape, seed=len(name))
        o = ops(inp)
        o.shared.pdl = pdl
        with o.shared.stream, heads_per_cta(group) if group else nullcontext():
            check(run_kernel(o, inp, cp.asarray, back), reference(inp))


@pytest.mark.parametrize("mma", [False, True], ids=["sparse_decode", "sparse_prefill"])
def test_a_captured_graph_replays_sparse_decode(mma):
    """sparse_decode (and its tensor-core form) captured once at V4-Flash's width (CSA), replayed on new queries and
    indexer ids: each replay matches the numpy attention of its inputs."""
    from engine.executor.gpu_graphs import capture_mode
    from test_dsv4_sparse_mma_emulated import SPARSE_MMA_BOUND, bf16_q

    inp = random_inputs(*CASES[3][1:], seed=1)
    o = ops(inp)
    o.sparse_mma_rows = 1 if mma else None
    with o.shared.stream:
        q, tables, pos, ids, sinks = (cp.asarray(a) for a in (inp.q, inp.tables, inp.pos, inp.ids, inp.sinks))
        o.sparse_decode(q, tables, pos, ids, sinks, inp.spec)
        o.shared.stream.synchronize()
        o.shared.stream.begin_capture(*capture_mode())
        out = o.sparse_decode(q, tables, pos, ids, sinks, inp.spec)
        graph = o.shared.stream.end_capture()
        for seed in (2, 3):
            new = random_inputs(*CASES[3][1:], seed=seed)
            new.pool, new.tables, new.sinks = inp.pool, inp.tables, inp.sinks
            for dst, src in ((q, new.q), (pos, new.pos), (ids, new.ids)):
                dst.set(src, o.shared.stream)
            graph.launch(o.shared.stream)
            if mma:                 # q rounded to bf16 for its product: against the reference of that q
                got, want = back(out), reference(bf16_q(new))
                assert abs(got - want).max() <= SPARSE_MMA_BOUND * abs(want).max()
            else:
                check(back(out), reference(new))


@pytest.mark.parametrize("pdl", [False, True])
def test_sparse_prefill_matches_numpy_on_the_device(pdl):
    """dsv4_sparse_mma.cu's tensor-core form (GpuDSV4Ops.sparse_prefill) on the emulation's cases, logits peaked
    and spread, against the numpy definition with q rounded to bf16: the emulation's bound; and a step of many rows
    at V4-Flash's width (64 heads: every 16-head tile of the CTA) against the same."""
    from test_dsv4_sparse_mma_emulated import SPARSE_MMA_BOUND, bf16_q

    cases = [(name, shape, scale) for name, *shape in CASES for scale in (1, 1 / 16)]
    cases.append(("v4_flash_64_heads", (64, 512, 128, 4, 512, tuple(range(200, 3000, 45))), 1 / 16))
    for name, shape, scale in cases:
        inp = random_inputs(*shape, seed=len(name))
        inp.q = inp.q * scale
        inp = bf16_q(inp)
        o = ops(inp)
        o.shared.pdl, o.sparse_mma_rows = pdl, 1
        with o.shared.stream:
            got, want = run_kernel(o, inp, cp.asarray, back), reference(inp)
        err = float(abs(got - want).max() / max(1e-6, float(abs(want).max())))
        assert err <= SPARSE_MMA_BOUND, (name, scale, err)
