"""dsv4_indexer.cu (DeepSeek-V4's lightning indexer) run through GpuDSV4Ops on the host, without a GPU
(tests/cuda_emulation.h), against the numpy indexer at the tiny models' widths and DeepSeek-V4-Flash's
(tests/dsv4_indexer_cases.py states the checks). Skipped without g++ or the CUDA headers;
test_gpu_dsv4_indexer.py runs the same cases on the device."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_indexer_cases import CASES, check, edge_in_a_tie, random_inputs, reference, run_indexer
from test_deltanet_kernels_emulated import host
from test_dsv4_hc_emulated import EmulatedDSV4


def emulated_ops(inp) -> EmulatedDSV4:
    ops = EmulatedDSV4()
    ops.shared.kv_cache = host(inp.pool)
    return ops


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_indexer_matches_numpy(case):
    inp = random_inputs(*case[1:], seed=len(case[0]))
    want = reference(inp)
    check(run_indexer(emulated_ops(inp), inp, host, np.asarray), want, inp)


def test_the_real_width_case_puts_the_top_k_edge_in_a_tie():
    """The tie rule decides picks there: the case tests it, not only distinct scores."""
    inp = random_inputs(*CASES[-1][1:], seed=len(CASES[-1][0]))
    assert edge_in_a_tie(inp, reference(inp))


def test_the_check_fails_on_the_other_tie_rule():
    """Equal scores taken the higher entry first (the ids of reversed entries mapped back) fail the check."""
    inp = random_inputs(*CASES[-1][1:], seed=len(CASES[-1][0]))
    want = reference(inp)
    got = run_indexer(emulated_ops(inp), inp, host, np.asarray)
    n = got["scores"].shape[1]
    for r, s in enumerate(got["scores"]):
        flipped = np.sort(n - 1 - np.argsort(-s[::-1], kind="stable")[:inp.spec.index_topk])
        got["ids"][r, :len(flipped)] = flipped
    with pytest.raises(AssertionError):
        check(got, want, inp)


def test_widths_the_kernels_cannot_take_are_refused_at_start():
    """dsv4_indexer.cu's query in shared memory, its 4-value key loads, dsv4_compress.cu's entry in shared memory."""
    import dataclasses

    from engine.loader import load_model
    from harness.models import tiny_model_path

    model = load_model(tiny_model_path("deepseek_v4")).model
    model.check_gpu_shapes()
    good = model.v4
    for bad in ({"index_dim": 18}, {"index_heads": 65, "index_dim": 128}, {"head_dim": 1028}):
        model.v4 = dataclasses.replace(good, **bad)
        with pytest.raises(ValueError, match="multiples of 4"):
            model.check_gpu_shapes()


def test_indexer_ids_in_row_chunks_match_one_launch(monkeypatch):
    """indexer_ids over a prompt's rows whose scores would pass INDEXER_SCORES_BYTES takes them a few rows at a
    time (here 5 of 18, the last chunk short): the ids of one launch over every row."""
    from dsv4_indexer_cases import device_rows

    from engine.executor import gpu_dsv4_ops

    inp = random_inputs(*CASES[1][1:], seed=4)
    ops, rows, stride = emulated_ops(inp), device_rows(inp, host), int(inp.ctx_lens.max()) // 4
    whole = np.asarray(ops.indexer_topk(0, *rows, inp.spec, stride)[0])
    monkeypatch.setattr(gpu_dsv4_ops, "INDEXER_SCORES_BYTES", 4 * stride * 5)
    assert len(whole) == 18 and (whole >= 0).any()
    np.testing.assert_array_equal(np.asarray(ops.indexer_ids(*rows, inp.spec, stride)), whole)
