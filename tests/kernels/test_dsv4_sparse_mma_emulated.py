"""dsv4_sparse_mma.cu (DeepSeek-V4's attention of many rows on tensor cores: sparse_decode's definition, the row's
heads the mma's M) run through GpuDSV4Ops.sparse_prefill on the host, without a GPU (tests/cuda_emulation.h, its
ldmatrix and mma emulated), against the numpy definition on the cases of tests/dsv4_attention_cases.py (sliding,
CSA with -1 padded ids, HCA, padding rows, a row of more keys than a chunk resolves, V4-Flash's width) with q
rounded to bf16 as the kernel takes it: within SPARSE_MMA_BOUND of the output's scale (the probabilities rounded to
bf16 for P·V, as FlashAttention does). The check fails with the sinks left out or one key tile's stage skipped.
test_gpu_dsv4_attention.py runs the same on the device."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_attention_cases import CASES, random_inputs, reference
from dsv4_indexer_cases import bf16, f32
from test_deltanet_kernels_emulated import host
from test_dsv4_indexer_emulated import emulated_ops as emulated

SPARSE_MMA_BOUND = 4e-3      # of max |out|: bf16 probabilities (2^-9 relative each); measured <= 2.3e-3


def run_mma(inp) -> np.ndarray:
    ops = emulated(inp)
    ops.sparse_mma_rows = 1
    ids = None if inp.ids is None else host(inp.ids)
    return np.asarray(ops.sparse_decode(host(inp.q), host(inp.tables), host(inp.pos), ids, host(inp.sinks), inp.spec))


def bf16_q(inp):
    inp.q = f32(bf16(inp.q))
    return inp


def check_close(got, want) -> float:
    err = float(np.abs(got - want).max() / max(1e-6, float(np.abs(want).max())))
    assert err <= SPARSE_MMA_BOUND, err
    return err


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("q_scale", [1, 1 / 16], ids=["peaked", "spread"])
def test_sparse_prefill_matches_numpy(case, q_scale):
    """q_scale 1: logits of tens (a few keys take the weight); 1/16: of order one (every key and the sink count)."""
    inp = random_inputs(*case[1:], seed=len(case[0]))
    inp.q = inp.q * q_scale
    inp = bf16_q(inp)
    print(case[0], q_scale, check_close(run_mma(inp), reference(inp)))


def test_the_check_fails_without_the_sinks():
    """(q scaled down: logits of order one, where a sink takes a real share of the denominator.)"""
    inp = random_inputs(*CASES[1][1:], seed=3)
    inp.q = inp.q / 16
    inp = bf16_q(inp)
    check_close(run_mma(inp), reference(inp))
    got = run_mma(inp)
    inp.sinks = np.full_like(inp.sinks, -np.inf)
    with pytest.raises(AssertionError):
        check_close(got, reference(inp))


def test_steps_route_by_rows_and_shared_memory():
    """sparse_decode hands a step of sparse_mma_rows rows or more to sparse_prefill (None: never); a head dim whose
    stages would pass a CTA's shared memory stays on sparse_decode (V4's 512 fits, 1024 would not)."""
    from engine.executor.gpu_dsv4_ops import SMEM_PER_BLOCK, sparse_smem_bytes

    inp = random_inputs(*CASES[1][1:], seed=1)              # 4 rows
    ops, taken = emulated(inp), []
    ops.sparse_prefill = lambda *args: taken.append(len(args[0])) or np.zeros_like(args[0])
    for rows, want in ((4, [4]), (5, []), (None, [])):
        taken.clear()
        ops.sparse_mma_rows = rows
        ops.sparse_decode(host(inp.q), host(inp.tables), host(inp.pos), host(inp.ids), host(inp.sinks), inp.spec)
        assert taken == want, rows
    assert sparse_smem_bytes(512, 4) <= SMEM_PER_BLOCK < sparse_smem_bytes(1024, 4)
