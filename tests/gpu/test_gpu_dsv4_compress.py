"""dsv4_compress.cu (DeepSeek-V4's compressor closing its windows) on the device through GpuDSV4Ops, against the
numpy close_entries: the cases and checks of the host emulation (tests/dsv4_compress_cases.py), at the tiny
models' widths and DeepSeek-V4-Flash's."""
from __future__ import annotations

import pytest
from dsv4_compress_cases import CASES, check, random_inputs, reference, run_compress
from test_gpu_dsv4_hc import DeviceShared, back

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("pdl", [False, True])
def test_compressor_matches_numpy_on_the_device(case, pdl):
    from engine.executor.gpu_dsv4_ops import GpuDSV4Ops

    o = GpuDSV4Ops(DeviceShared(), None)
    o.shared.pdl = pdl
    inp = random_inputs(*case[1:], seed=len(case[0]))
    with o.shared.stream:
        got = run_compress(o, inp, cp.asarray, back)
    check(got, reference(inp), inp)
