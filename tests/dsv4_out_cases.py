"""DeepSeek-V4's grouped output projection (wo_a) through GpuDSV4Ops.grouped_linear (the MoE part's grouped
products over the bf16 weight, group g as expert g) against the numpy definition (cpu_dsv4_ops.grouped_linear) on
the same bf16-rounded inputs: the tiny model's groups and V4-Flash's (8 groups of 1024 outputs over 4096 inputs),
a few tokens (moe_gemv.cu) and more (the grouped GEMM, one and two M-tiles a group). Shared by the host emulation
(tests/kernels/test_dsv4_out_emulated.py) and the device test (tests/gpu/test_gpu_dsv4_out.py). Bound: bf16's
rounding of the output (2^-8 of its magnitude) plus float32 sums in another order (1e-5 of sum |x·w|)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from dsv4_indexer_cases import bf16, f32

from engine.executor.cpu_dsv4_ops import grouped_linear

# (name, groups, outputs a group N, inputs a group K)
CASES = [("tiny", 2, 16, 64), ("v4_flash", 8, 1024, 4096)]
TOKENS = (1, 3, 32, 100)


def random_inputs(groups: int, n: int, k: int, tokens: int, seed: int) -> SimpleNamespace:
    """x float32 [tokens, groups·k] and the weight as bf16 bits [groups·n, k]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, groups * k)).astype(np.float32)
    return SimpleNamespace(groups=groups, x=x, w=bf16(rng.standard_normal((groups * n, k)) / np.sqrt(k)))


def reference(inp) -> tuple[np.ndarray, np.ndarray]:
    """(the grouped product of the bf16-rounded x and weight in float64, its sum of |x·w| per output)."""
    x, w = f32(bf16(inp.x)).astype(np.float64), f32(inp.w).astype(np.float64)
    return grouped_linear(x, w, inp.groups), grouped_linear(np.abs(x), np.abs(w), inp.groups)


def check(got: np.ndarray, want) -> None:
    value, magnitude = want
    assert got.dtype == np.float32 and got.shape == value.shape, (got.dtype, got.shape)
    excess = np.abs(got - value) - (2.0 ** -8 * np.abs(value) + 1e-5 * magnitude)
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} outputs off, worst by {excess.max():.3g}"


def run(ops, inp, to_device, back) -> np.ndarray:
    return back(ops.grouped_linear(to_device(inp.x), to_device(inp.w), inp.groups))
