"""dsv4_compress.cu (DeepSeek-V4's compressor closing its windows) run through GpuDSV4Ops on the host, without a
GPU (tests/cuda_emulation.h), against the numpy close_entries at the tiny models' widths and DeepSeek-V4-Flash's
(tests/dsv4_compress_cases.py states the checks). Skipped without g++ or the CUDA headers;
test_gpu_dsv4_compress.py runs the same cases on the device."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_compress_cases import CASES, check, random_inputs, reference, run_compress
from test_deltanet_kernels_emulated import host
from test_dsv4_hc_emulated import EmulatedDSV4


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_compressor_matches_numpy(case):
    inp = random_inputs(*case[1:], seed=len(case[0]))
    check(run_compress(EmulatedDSV4(), inp, host, np.asarray), reference(inp), inp)


def test_the_check_fails_without_the_previous_window():
    """CSA's entries computed from their own window only (the kernel told the windows do not overlap, its own
    series read as the only one) fail the check."""
    inp = random_inputs(*CASES[0][1:], seed=3)
    want = reference(inp)
    ops = EmulatedDSV4()
    launch = ops.shared.launch

    def no_overlap(k, grid, block, args, shared_mem=0):
        args = list(args)
        args[11] = np.int32(0)
        launch(k, grid, block, args, shared_mem)

    ops.shared.launch = no_overlap
    with pytest.raises(AssertionError):
        check(run_compress(ops, inp, host, np.asarray), want, inp)
