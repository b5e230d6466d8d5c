"""NVTX ranges per op (OPENINFER_LAYER_RANGES=ops): each GpuOps op runs inside a range of its name
when op_ranges is on, a composed op's parts nest inside it, and nothing is pushed when it is off.
CPU only: GpuOps' real norm_linear over stand-in leaf ops wrapped by the real op_range."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np

import engine.executor.gpu_graphs as gpu_graphs
from engine.executor.gpu_ops import GpuOps, op_range


def test_op_ranges_nest_and_stay_off_by_default(monkeypatch):
    log = []

    @contextlib.contextmanager
    def fake_range(name):
        log.append(("push", name))
        yield
        log.append(("pop", name))

    monkeypatch.setattr(gpu_graphs, "nvtx_range", fake_range)

    class Leafy(GpuOps):
        """No device: gemv.cu declines, so norm_linear composes rms_norm and linear (the leaves below)."""

        def __init__(self):
            self.shared = SimpleNamespace(gemm=SimpleNamespace(gemv_serves=lambda *a, **k: False))

        @op_range
        def rms_norm(self, x, weight, eps, residual=None):
            log.append(("run", "rms_norm"))
            return x, x

        @op_range
        def linear(self, x, weight, bias=None):
            log.append(("run", "linear"))
            return x

    ops = Leafy()
    x, w = np.zeros((1, 8)), np.zeros((8, 8))
    ops.norm_linear(x, w, 1e-6, w)
    assert log == [("run", "rms_norm"), ("run", "linear")]
    log.clear()
    ops.op_ranges = True
    ops.norm_linear(x, w, 1e-6, w)
    assert log == [("push", "norm_linear"), ("push", "rms_norm"), ("run", "rms_norm"), ("pop", "rms_norm"),
                   ("push", "linear"), ("run", "linear"), ("pop", "linear"), ("pop", "norm_linear")]
