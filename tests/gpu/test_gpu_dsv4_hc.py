"""dsv4_hc.cu (DeepSeek-V4's hyper-connection kernels) on the device through GpuDSV4Ops, against the numpy
reference: the cases and tolerances of the host emulation (tests/dsv4_hc_cases.py), at the tiny models' widths
and DeepSeek-V4-Flash's, plus a replay of the same launches captured in a CUDA graph (the split rows' counters
reset by the kernels themselves, nothing read on the host)."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_hc_cases import SHAPES, check, random_inputs, reference, run_kernels

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


class DeviceShared:
    """What GpuDSV4Ops uses of GpuShared: the stream, the launch and the SM count."""
    pdl = False

    def __init__(self):
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def launch(self, k, grid, block, args, shared_mem: int = 0) -> None:
        from openinfer_kernels.raw_cuda.launch import launch

        launch(k, grid, block, args, self.stream, pdl=self.pdl, shared_mem=shared_mem)


def ops():
    from engine.executor.gpu_dsv4_ops import GpuDSV4Ops

    return GpuDSV4Ops(DeviceShared(), None)


def back(a) -> np.ndarray:
    cp.cuda.get_current_stream().synchronize()
    return cp.asnumpy(a)


@pytest.mark.parametrize("T,N,D", SHAPES, ids=str)
@pytest.mark.parametrize("pdl", [False, True])
def test_kernels_match_numpy_on_the_device(T, N, D, pdl):
    o = ops()
    o.shared.pdl = pdl
    inp = random_inputs(T, N, D, seed=N * D + T)
    with o.shared.stream:
        got = run_kernels(o, inp, cp.asarray, back)
    check(got, reference(inp))


def test_a_captured_graph_replays_the_kernels():
    """hyper_connection + hc_merge captured once at V4-Flash's width (16 CTAs a row: the counters), replayed on
    new inputs written into the captured buffers: each replay matches numpy."""
    from engine.executor.gpu_graphs import capture_mode

    o, T, N, D = ops(), 4, 4, 4096
    first = random_inputs(T, N, D, seed=1)
    streams, out = cp.asarray(first.streams), cp.asarray(first.out_bf16)
    fn, base, scale = cp.asarray(first.fn), cp.asarray(first.base), cp.asarray(first.scale)
    with o.shared.stream:
        warm = o.hyper_connection(streams, fn, base, scale, 20, 1e-6, 1e-6)    # compiled, float32 weights kept,
        o.hc_merge(out, streams, *warm[:2])                                     # the pool's blocks there
        del warm
        o.shared.stream.synchronize()
        o.shared.stream.begin_capture(*capture_mode())
        post, comb, x = o.hyper_connection(streams, fn, base, scale, 20, 1e-6, 1e-6)
        merged = o.hc_merge(out, streams, post, comb)
        graph = o.shared.stream.end_capture()
        for seed in (2, 3):
            inp = random_inputs(T, N, D, seed=seed)
            inp.fn, inp.base, inp.scale = first.fn, first.base, first.scale
            streams.set(inp.streams, o.shared.stream)
            out.set(inp.out_bf16, o.shared.stream)
            graph.launch(o.shared.stream)
            check({"post": back(post), "comb": back(comb), "collapsed": back(x), "merged_bf16": back(merged)},
                  reference(inp))
