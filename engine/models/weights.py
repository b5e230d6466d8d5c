"""Weight declarations: each model lists the tensors it runs on (engine names, packed) and the
checkpoint tensors each one is concatenated from, so loading checks every name and shape once.
Mixture-of-experts weights are stacked: one engine tensor [experts, N, K] from per-expert tensors."""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from memory.packed_weight import PackedWeight

Shape = tuple[int, ...]
LOAD_WORKERS = max(1, min(16, (os.cpu_count() or 1) - 1))


@dataclass(frozen=True)
class WeightSpec:
    """Engine weight `name` = concatenation along dim 0 of checkpoint tensors `parts`
    (each a (checkpoint name, expected shape)); a single part is used as is, without a copy.
    experts > 0: the parts are that many equal groups (one expert's tensors each), each group
    concatenated along dim 0 and the groups stacked: [experts, rows, ...]."""
    name: str
    parts: tuple[tuple[str, Shape], ...]
    experts: int = 0

    @property
    def shape(self) -> Shape:
        first = self.parts[0][1]
        if self.experts:
            rows = sum(s[0] for _, s in self.parts[: len(self.parts) // self.experts])
            return (self.experts, rows, *first[1:])
        return (sum(s[0] for _, s in self.parts), *first[1:])


def packed(name: str, *parts: tuple[str, Shape]) -> WeightSpec:
    return WeightSpec(name, tuple((n, tuple(s)) for n, s in parts))


def stacked(name: str, groups: list[list[tuple[str, Shape]]]) -> WeightSpec:
    """Engine weight [E, rows, ...] from E groups of checkpoint tensors (group e: expert e's parts,
    concatenated along dim 0), e.g. gate_up [E, 2I, H] from each expert's gate_proj and up_proj."""
    if not groups or len({len(g) for g in groups}) != 1:
        raise ValueError(f"{name}: expert groups must be non-empty and of one size")
    return WeightSpec(name, tuple((n, tuple(s)) for g in groups for n, s in g), experts=len(groups))


def pack_weights(specs: list[WeightSpec], has: Callable[[str], bool],
                 get: Callable[[str], np.ndarray], where: str = "checkpoint",
                 keep: Callable[[WeightSpec], object | None] | None = None) -> dict[str, np.ndarray]:
    """Build the engine weights from checkpoint tensors (kept in their stored dtype; a weight of
    several parts as a PackedWeight of them). Stacked experts are fetched and written by LOAD_WORKERS
    threads (a quantized checkpoint's `get` dequantizes: numpy work that drops the GIL). keep(spec): the
    weight kept quantized (engine/loader/kept_linear.py), None to build it from has / get.
    Raises KeyError / ValueError naming the tensor (and both shapes) on a missing tensor or a
    shape mismatch."""
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        kept = keep(spec) if keep is not None else None
        if kept is not None:
            out[spec.name] = kept
            continue
        for src, _ in spec.parts:
            if not has(src):
                raise KeyError(f"missing tensor {src!r} (for {spec.name}) in {where}")
        fetch = functools.partial(_fetch, get, where)
        if spec.experts:
            out[spec.name] = _stack(spec, fetch)
        else:
            arrays = [fetch(part) for part in spec.parts]
            out[spec.name] = arrays[0] if len(arrays) == 1 else PackedWeight(arrays)
    return out


def _fetch(get: Callable[[str], np.ndarray], where: str, part: tuple[str, Shape]) -> np.ndarray:
    src, shape = part
    a = get(src)
    if tuple(a.shape) != shape:
        raise ValueError(f"tensor {src!r} in {where} has shape {tuple(a.shape)}, expected {shape}")
    return a


def _stack(spec: WeightSpec, fetch: Callable[[tuple[str, Shape]], np.ndarray]) -> np.ndarray:
    """The expert groups of spec written into one [experts, rows, ...] array (expert 0 first, for the
    dtype; the others by a thread pool, each expert's parts freed once written)."""
    per = len(spec.parts) // spec.experts
    first = [fetch(p) for p in spec.parts[:per]]
    out = np.empty(spec.shape, np.result_type(*[a.dtype for a in first]))

    def write(e: int, arrays: list[np.ndarray] | None = None) -> None:
        row, parts = 0, spec.parts[e * per:(e + 1) * per]
        for part, a in zip(parts, arrays or [fetch(p) for p in parts]):
            if np.result_type(a.dtype, out.dtype) != out.dtype:
                raise ValueError(f"tensor {part[0]!r} ({a.dtype}) does not fit {spec.name}'s {out.dtype} "
                                 f"(experts of mixed dtypes)")
            out[e, row:row + a.shape[0]] = a
            row += a.shape[0]

    write(0, first)
    del first
    with ThreadPoolExecutor(LOAD_WORKERS) as pool:
        list(pool.map(write, range(1, spec.experts)))
    return out


def check_weights(specs: list[WeightSpec], weights: Mapping[str, np.ndarray]) -> None:
    """Check an already-packed weight dict against the declaration."""
    for spec in specs:
        if spec.name not in weights:
            raise KeyError(f"missing weight {spec.name!r}")
        if tuple(weights[spec.name].shape) != spec.shape:
            raise ValueError(f"weight {spec.name!r} has shape {tuple(weights[spec.name].shape)}, "
                             f"expected {spec.shape}")
