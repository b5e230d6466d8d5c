"""dsv4_attention.cu (DeepSeek-V4's decode attention: the sliding window and the compressed entries with the per-head
sinks, over the paged rows; and write_rows, store_rows' kernel) run through GpuDSV4Ops on the host, without a GPU
(tests/cuda_emulation.h), against the numpy definition: the cases and bound of tests/dsv4_attention_cases.py; the
check fails with the sinks left out. Skipped without g++ or the CUDA headers; test_gpu_dsv4_attention.py runs the
same cases on the device."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_attention_cases import CASES, check, heads_per_cta, random_inputs, reference, run_kernel
from dsv4_indexer_cases import bf16
from test_deltanet_kernels_emulated import host
from test_dsv4_hc_emulated import EmulatedDSV4
from test_dsv4_indexer_emulated import emulated_ops as emulated


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_sparse_decode_matches_numpy(case):
    inp = random_inputs(*case[1:], seed=len(case[0]))
    check(run_kernel(emulated(inp), inp, host, np.asarray), reference(inp))


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]], ids=lambda c: c[0])
def test_sparse_decode_with_heads_grouped_matches_numpy(case, group):
    """A CTA over 2 or 4 heads (batch 32 and up at V4-Flash's 64 heads) sharing each key's load."""
    inp = random_inputs(*case[1:], seed=len(case[0]))
    with heads_per_cta(group):
        check(run_kernel(emulated(inp), inp, host, np.asarray), reference(inp))


def test_the_check_fails_without_the_sinks():
    inp = random_inputs(*CASES[1][1:], seed=3)
    got = run_kernel(emulated(inp), inp, host, np.asarray)
    inp.sinks = np.full_like(inp.sinks, -np.inf)
    with pytest.raises(AssertionError):
        check(got, reference(inp))


def test_store_rows_skips_padding_slots():
    """Rows land as bf16 at their slots from their column; a padding or replayed row's slot -1 (a prefix hit's
    replayed positions) writes nothing (a fancy-indexed store would write the pool's last slot)."""
    rng = np.random.default_rng(0)
    pool = bf16(rng.standard_normal((1, 1, 48, 1, 40)))
    rows = rng.standard_normal((3, 24)).astype(np.float32)
    ops, slots = EmulatedDSV4(), np.array([5, -1, 30], np.int32)
    ops.shared.kv_cache = host(pool.copy())
    ops.store_rows(0, host(slots), host(rows), col=8)
    want = pool.copy()
    want[0, 0, [5, 30], 0, 8:32] = bf16(rows[[0, 2]])
    np.testing.assert_array_equal(np.asarray(ops.shared.kv_cache), want)


def test_heads_per_cta_grow_with_the_batch_within_the_registers():
    """sparse_decode's ATT_G at V4-Flash's 64 heads on 132 SMs: one head a CTA at batch 1, 2 once the rows fill
    1.5 CTAs an SM (batch 7; at 8 rows G2 measured 20% faster than G1), 4 from batch 13; a head of 1,024 values
    (8 pieces) never past 2."""
    from engine.executor.attention_grid import sparse_heads_per_cta

    assert [sparse_heads_per_cta(b, 64, 4, 132) for b in (1, 6, 7, 12, 13, 128)] == [1, 1, 2, 2, 4, 4]
    assert sparse_heads_per_cta(128, 64, 8, 132) == 2
    assert sparse_heads_per_cta(128, 3, 4, 132) == 1          # heads no group divides
