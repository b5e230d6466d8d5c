"""Weight declarations: each model lists the tensors it runs on (engine names, packed) and the
checkpoint tensors each one is concatenated from, so loading checks every name and shape once.
Mixture-of-experts weights are stacked: one engine tensor [experts, N, K] from per-expert tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

Shape = tuple[int, ...]


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


class PackedWeight:
    """An engine weight concatenated from checkpoint tensors along dim 0, kept as its parts (memory-mapped
    views) until someone needs it whole: an executor copies each part straight into its place (the GPU
    upload, with no host-side concatenation), np.asarray() concatenates."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.dtype = np.result_type(*[a.dtype for a in parts])
        self.shape = (sum(a.shape[0] for a in parts), *parts[0].shape[1:])
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(a, dtype=self.dtype) for a in self.parts], axis=0)
        return whole if dtype is None else whole.astype(dtype)


def packed(name: str, *parts: tuple[str, Shape]) -> WeightSpec:
    return WeightSpec(name, tuple((n, tuple(s)) for n, s in parts))


def stacked(name: str, groups: list[list[tuple[str, Shape]]]) -> WeightSpec:
    """Engine weight [E, rows, ...] from E groups of checkpoint tensors (group e: expert e's parts,
    concatenated along dim 0), e.g. gate_up [E, 2I, H] from each expert's gate_proj and up_proj."""
    if not groups or len({len(g) for g in groups}) != 1:
        raise ValueError(f"{name}: expert groups must be non-empty and of one size")
    return WeightSpec(name, tuple((n, tuple(s)) for g in groups for n, s in g), experts=len(groups))


def pack_weights(specs: list[WeightSpec], has: Callable[[str], bool],
                 get: Callable[[str], np.ndarray], where: str = "checkpoint") -> dict[str, np.ndarray]:
    """Build the engine weights from checkpoint tensors (kept in their stored dtype; a weight of
    several parts as a PackedWeight of them).
    Raises KeyError / ValueError naming the tensor (and both shapes) on a missing tensor or a
    shape mismatch."""
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        arrays = []
        for src, shape in spec.parts:
            if not has(src):
                raise KeyError(f"missing tensor {src!r} (for {spec.name}) in {where}")
            a = get(src)
            if tuple(a.shape) != shape:
                raise ValueError(f"tensor {src!r} in {where} has shape {tuple(a.shape)}, "
                                 f"expected {shape}")
            arrays.append(a)
        if spec.experts:
            out[spec.name] = _stack(arrays, spec)
        else:
            out[spec.name] = arrays[0] if len(arrays) == 1 else PackedWeight(arrays)
    return out


def _stack(arrays: list[np.ndarray], spec: WeightSpec) -> np.ndarray:
    """The expert groups of `arrays` written into one [experts, rows, ...] array."""
    out = np.empty(spec.shape, np.result_type(*[a.dtype for a in arrays]))
    per = len(arrays) // spec.experts
    for e in range(spec.experts):
        row = 0
        for a in arrays[e * per:(e + 1) * per]:
            out[e, row:row + a.shape[0]] = a
            row += a.shape[0]
    return out


def check_weights(specs: list[WeightSpec], weights: Mapping[str, np.ndarray]) -> None:
    """Check an already-packed weight dict against the declaration."""
    for spec in specs:
        if spec.name not in weights:
            raise KeyError(f"missing weight {spec.name!r}")
        if tuple(weights[spec.name].shape) != spec.shape:
            raise ValueError(f"weight {spec.name!r} has shape {tuple(weights[spec.name].shape)}, "
                             f"expected {spec.shape}")
