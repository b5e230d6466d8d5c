"""A tensor-parallel rank's shard of a weight kept quantized (engine/models/quant_linear.py, quant_experts.py):
its codes and their scales (and zeros) cut together, never dequantized, so every rank keeps 1 / N of the bytes
and runs the one-device kernels on its shard (the numpy ranks; a GPU rank dequantizes its shard at start,
dequantized_model, until its rank ops serve kept weights).

* column-parallel (ROWS, a cut along N): FP8 block scales [ceil(N/128), K/128] follow their 128-row blocks,
  so every cut must fall on a 128-row boundary (or the weight's end); FP8 channel scales [N] and the int4
  group scales / zeros [N, K / group] follow the rows, any cut serves;
* row-parallel (COLS, a cut along K): FP8 cuts fall on 128-column boundaries (the block scales' columns, and
  the activations' per-token 128-groups, which then quantize on each rank as on one device); int4 cuts on
  the group size (the scales' and zeros' columns);
* EXPERTS: the rank's whole experts, each with its own scales.

A cut that splits a scale block or a group is refused at start (ValueError naming the weight and the sizes).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.models.quant_experts import KEPT, Fp8Experts, W4Experts
from engine.models.quant_linear import Fp8Linear, W4Linear, fp8_concat, w4_concat
from openinfer_kernels.quant.fp8_ref import GROUP
from openinfer_kernels.quant.w4_formats import W4Codes, expert_codes

Span = tuple[int, int]               # [first, end) rows or columns


def cut_unit(w: Fp8Linear | W4Linear, axis: int) -> int:
    """The rows (axis 0) or columns (axis 1) a cut of `w` must fall on a multiple of (1: anywhere)."""
    if isinstance(w, W4Linear):
        return w.w4.group if axis == 1 else 1
    return GROUP if axis == 1 or not w.channel else 1


def check_cuts(name: str, w: Fp8Linear | W4Linear, axis: int, spans: list[Span], rank: int, world_size: int) -> None:
    """ValueError naming the weight, its format and sizes where a cut of `spans` splits a scale block or group."""
    unit, size = cut_unit(w, axis), w.shape[axis]
    for first, end in spans:
        if first % unit or (end % unit and end != size):
            what = ("rows", "N") if axis == 0 else ("columns", "K")
            raise ValueError(
                f"tensor_parallel_size {world_size}: {name} ({w.describe()}, [N, K] = {list(w.shape)}) would give rank "
                f"{rank} its {what[0]} {first}..{end}, not on the {unit}-{what[0][:-1]} boundaries its scales need; "
                f"serve it on fewer ranks, or with its weights dequantized")


def rows_of(w: Fp8Linear | W4Linear, first: int, end: int) -> Fp8Linear | W4Linear:
    """Rows first..end of a kept weight (views), with their scales (and zeros)."""
    if isinstance(w, W4Linear):
        return W4Linear(expert_codes(w.w4, slice(first, end)))
    scale = w.scale[first:end] if w.channel else w.scale[first // GROUP:-(-end // GROUP)]
    return Fp8Linear(w.codes[first:end], scale)


def cols_of(w: Fp8Linear | W4Linear, first: int, end: int) -> Fp8Linear | W4Linear:
    """Columns first..end of a kept weight (contiguous copies), with their scales (and zeros)."""
    cut = lambda a, unit: np.ascontiguousarray(a[:, first // unit:end // unit])    # noqa: E731
    if isinstance(w, W4Linear):
        c = w.w4
        zeros = None if c.zeros is None else cut(c.zeros, c.group)
        return W4Linear(W4Codes(cut(c.codes, 1), cut(c.scales, c.group), c.scale_dtype, zeros, c.group, c.fp4))
    return Fp8Linear(cut(np.asarray(w.codes), 1), w.scale if w.channel else cut(w.scale, GROUP))


def kept_shard(name: str, w: Fp8Linear | W4Linear, axis: int, spans: list[Span]):
    """The rank's shard of a kept linear weight: its `spans` along `axis` (rows: one per packed part, joined
    along N again), its cuts checked at start (check_cuts, through sharding.check_kept_cuts)."""
    if axis == 1:
        (first, end), = spans
        return cols_of(w, first, end)
    parts = [rows_of(w, first, end) for first, end in spans]
    joined = w4_concat(parts) if isinstance(w, W4Linear) else fp8_concat(parts)
    if joined is None:
        raise ValueError(f"{name}: the shards of its packed parts do not join ({w.describe()})")
    return joined


def experts_of(w: Fp8Experts | W4Experts, first: int, count: int) -> Fp8Experts | W4Experts:
    """Experts first..first+count of kept experts (views), with their scales (and zeros)."""
    e = slice(first, first + count)
    if isinstance(w, Fp8Experts):
        return Fp8Experts(w.codes[e], w.scale[e])
    return W4Experts(expert_codes(w.w4, e))


def dequantized_model(model):
    """The loaded model (a rank's shard) with its kept quantized weights dequantized to float32."""
    if not any(isinstance(w, KEPT) for w in model.weights.values()):
        return model
    return replace(model, weights={name: w.dequantized() if isinstance(w, KEPT) else w
                                   for name, w in model.weights.items()})
