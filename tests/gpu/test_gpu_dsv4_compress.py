"""dsv4_compress.cu (DeepSeek-V4's compressor closing its windows from the step's inputs and the sequences' rings,
and ring_store) on the device through GpuDSV4Ops, against the definition: the cases and checks of the host
emulation (tests/dsv4_compress_cases.py), at the tiny models' widths and DeepSeek-V4-Flash's, plus the decode
form captured in a CUDA graph and replayed."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_compress_cases import (CASES, check, check_a_replayed_close_writes_nothing, check_decode_ring,
                                 check_ring_store, decode_step, device_state, launch_decode, random_inputs, reference,
                                 run_compress, run_decode, run_ring_store)
from test_gpu_dsv4_hc import DeviceShared, back

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def ops(pdl: bool = False):
    from engine.executor.gpu_dsv4_ops import GpuDSV4Ops

    o = GpuDSV4Ops(DeviceShared(), None)
    o.shared.pdl = pdl
    return o


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("pdl", [False, True])
def test_compressor_matches_numpy_on_the_device(case, pdl):
    o, inp = ops(pdl), random_inputs(*case[1:], seed=len(case[0]))
    check_a_replayed_close_writes_nothing(inp)
    with o.shared.stream:
        got = run_compress(o, inp, cp.asarray, back)
    check(got, reference(inp), inp)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_decode_form_and_the_ring_on_the_device(case):
    o, inp = ops(), random_inputs(*case[1:], seed=len(case[0]))
    one = np.flatnonzero((inp.pos >= 0).sum(1) == 1)
    with o.shared.stream:
        pool, ring = run_decode(o, inp, cp.asarray, back)
        check((pool, ring), reference(inp, one), inp, one)
        check_decode_ring(ring, inp)
        check_ring_store(run_ring_store(o, inp, cp.asarray, back), inp)


def test_a_captured_graph_replays_the_decode_form():
    """compress_windows and store_ring as device_attention launches them, captured once (V4-Flash's CSA) and
    replayed on the pool and ring put back in the captured buffers: each replay gives the definition's entries
    and ring."""
    from engine.executor.gpu_graphs import capture_mode

    o, inp = ops(), random_inputs(*CASES[2][1:], seed=1)
    one = np.flatnonzero((inp.pos >= 0).sum(1) == 1)
    want = reference(inp, one)
    with o.shared.stream:
        step = decode_step(inp, cp.asarray)
        pool = device_state(o, inp, cp.asarray)
        ring = o.state[inp.spec.ring]
        launch_decode(o, inp, step)                                  # compiled, the weights converted and kept
        o.shared.stream.synchronize()
        o.shared.stream.begin_capture(*capture_mode())
        launch_decode(o, inp, step)
        graph = o.shared.stream.end_capture()
        for _ in range(2):
            pool.set(inp.pool, o.shared.stream)
            ring.set(inp.ring, o.shared.stream)
            graph.launch(o.shared.stream)
            got = back(pool), back(ring)
            check(got, want, inp, one)
            check_decode_ring(got[1], inp)
