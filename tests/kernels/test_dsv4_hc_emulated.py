"""dsv4_hc.cu (DeepSeek-V4's hyper-connection kernels) run through GpuDSV4Ops on the host, without a GPU
(tests/cuda_emulation.h, as test_deltanet_kernels_emulated), against the numpy reference at the tiny models'
widths and DeepSeek-V4-Flash's (tests/dsv4_hc_cases.py states the tolerances). Skipped without g++ or the CUDA
headers; test_gpu_dsv4_hc.py runs the same cases on the device."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from dsv4_hc_cases import SHAPES, check, random_inputs, reference, run_kernels
from test_deltanet_kernels_emulated import EmulatedShared, host

from engine.executor.gpu_dsv4_ops import GpuDSV4Ops


class HostNumpy:
    """numpy as the ops' array module, its new arrays passing for device arrays (host())."""

    def __getattr__(self, name):
        return getattr(np, name)

    def empty(self, shape, dtype=np.float32):
        a = np.empty(shape, dtype)
        a.fill(np.nan if a.dtype.kind == "f" else 0x7FC0)       # unwritten outputs show as NaN
        return host(a)

    def zeros(self, shape, dtype=np.float32):
        return host(np.zeros(shape, dtype))

    def ascontiguousarray(self, a, dtype=None):
        return host(np.asarray(a, dtype))

    def asarray(self, a, dtype=None):
        return host(np.asarray(a, dtype))

    def arange(self, *args, dtype=None):
        return host(np.arange(*args, dtype=dtype))

    def where(self, condition, a, b):
        return host(np.where(condition, a, b))


class EmulatedHCShared(EmulatedShared):
    stream = contextlib.nullcontext()


class EmulatedDSV4(GpuDSV4Ops):
    """GpuDSV4Ops with numpy arrays and its launches run by the host emulation."""

    def __init__(self, shared=None, moe=None, state=None):
        super().__init__(shared or EmulatedHCShared(), moe, state, array_module=HostNumpy())

    def _kernel(self, name: str, entry: str, dynamic_smem: int = 0, **defines: int):
        return name, entry, tuple(sorted(defines.items()))


@pytest.mark.parametrize("T,N,D", SHAPES, ids=str)
def test_kernels_match_numpy(T, N, D):
    inp = random_inputs(T, N, D, seed=N * D + T)
    check(run_kernels(EmulatedDSV4(), inp, host, np.asarray), reference(inp))


def test_a_replay_finds_its_counters_back_at_zero():
    """Split rows (here 2 CTAs a row, V4-Flash 16) count their CTAs; the last resets the counter, so a second
    launch (a graph's replay) is right again."""
    ops, inp = EmulatedDSV4(), random_inputs(3, 2, 600, seed=7)
    want = reference(inp)
    for _ in range(2):
        check(run_kernels(ops, inp, host, np.asarray), want)
        assert not np.asarray(ops._hc_counter).any()


def test_the_check_fails_with_the_sinkhorn_cut_short():
    """5 of the 20 iterations (comb off by 2e-3; 19 would be within float32 rounding: it has converged)."""
    inp = random_inputs(3, 4, 256, seed=3)
    with pytest.raises(AssertionError):
        check(run_kernels(EmulatedDSV4(), inp, host, np.asarray, iters=5), reference(inp))


def test_more_streams_than_the_kernels_take_are_refused_at_start():
    import dataclasses

    from engine.loader import load_model
    from harness.models import tiny_model_path

    model = load_model(tiny_model_path("deepseek_v4")).model
    model.check_gpu_shapes()
    model.v4 = dataclasses.replace(model.v4, hc_mult=6)
    with pytest.raises(ValueError, match="hc_mult 1..5"):
        model.check_gpu_shapes()
