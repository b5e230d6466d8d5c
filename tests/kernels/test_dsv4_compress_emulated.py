"""dsv4_compress.cu (DeepSeek-V4's compressor closing its windows from the step's inputs and the sequences' rings,
and ring_store) run through GpuDSV4Ops on the host, without a GPU (tests/cuda_emulation.h), against the
definition at the tiny models' widths and DeepSeek-V4-Flash's (tests/dsv4_compress_cases.py states the checks).
Skipped without g++ or the CUDA headers; test_gpu_dsv4_compress.py runs the same cases on the device."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_compress_cases import (CASES, check, check_a_replayed_close_writes_nothing, check_decode_ring,
                                 check_ring_store, random_inputs, reference, run_compress, run_decode, run_ring_store)
from test_deltanet_kernels_emulated import host
from test_dsv4_hc_emulated import EmulatedDSV4


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_compressor_matches_numpy(case):
    inp = random_inputs(*case[1:], seed=len(case[0]))
    check_a_replayed_close_writes_nothing(inp)
    check(run_compress(EmulatedDSV4(), inp, host, np.asarray), reference(inp), inp)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c[0])
def test_decode_closes_from_the_ring_and_stores_its_inputs(case):
    """compress_windows as device_attention launches it (device arrays, a token's first position its own) and
    store_ring."""
    inp = random_inputs(*case[1:], seed=len(case[0]))
    one = np.flatnonzero((inp.pos >= 0).sum(1) == 1)
    pool, ring = run_decode(EmulatedDSV4(), inp, host, np.asarray)
    check((pool, ring), reference(inp, one), inp, one)
    check_decode_ring(ring, inp)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c[0])
def test_a_mixed_steps_ring_keeps_each_sequences_last_inputs(case):
    inp = random_inputs(*case[1:], seed=len(case[0]))
    check_ring_store(run_ring_store(EmulatedDSV4(), inp, host, np.asarray), inp)


def test_the_check_fails_without_the_previous_window():
    """CSA's entries computed from their own window only (the kernel told the windows do not overlap, its own
    series read as the only one) fail the check."""
    inp = random_inputs(*CASES[0][1:], seed=3)
    want = reference(inp)
    ops = EmulatedDSV4()
    launch = ops.shared.launch

    def no_overlap(k, grid, block, args, shared_mem=0):
        args = list(args)
        if k[1] == "compress_close":
            args[15] = np.int32(0)
        launch(k, grid, block, args, shared_mem)

    ops.shared.launch = no_overlap
    with pytest.raises(AssertionError):
        check(run_compress(ops, inp, host, np.asarray), want, inp)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c[0])
def test_the_check_fails_reading_another_sequences_ring(case):
    inp = random_inputs(*case[1:], seed=3)
    with pytest.raises(AssertionError):
        check(run_compress(EmulatedDSV4(), inp, host, np.asarray, ring_slots=np.roll(inp.ring_slots, 1)),
              reference(inp), inp)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c[0])
def test_the_check_fails_reading_the_steps_positions_from_the_ring(case):
    inp = random_inputs(*case[1:], seed=3)
    end = inp.start + (inp.pos >= 0).sum(1)
    with pytest.raises(AssertionError):
        check(run_compress(EmulatedDSV4(), inp, host, np.asarray, start=end), reference(inp), inp)
