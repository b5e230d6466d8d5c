"""Token → expert grouping for the grouped (MoE) GEMM, on the host with NumPy.

The grouped GEMM multiplies a row-block of A by one expert's weights per M-tile. ``group_by_expert``
turns the router's top-k choices into that layout: assignments sorted by expert (stable, so token
order is kept inside a group), each expert's group padded to whole tiles, the padded row of every
(token, slot) assignment, and the expert of every tile. The caller gathers activations into those
rows (padding rows may hold anything; their outputs are ignored), runs ``grouped_gemm`` and
scatters the rows back with the routing weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExpertGroups:
    """Padded expert-grouped layout of ``tokens·top_k`` assignments."""

    tile_m: int
    rows: np.ndarray         # int32 [tokens, top_k]: padded row of each assignment
    tile_expert: np.ndarray  # int32 [padded_rows / tile_m]: expert of each M-tile
    counts: np.ndarray       # int64 [num_experts]: assignments per expert

    @property
    def padded_rows(self) -> int:
        return int(self.tile_expert.size * self.tile_m)


def group_by_expert(expert_ids: np.ndarray, num_experts: int, tile_m: int = 64) -> ExpertGroups:
    """Group the ``[tokens, top_k]`` router choices by expert, each group padded to ``tile_m`` rows."""
    ids = np.asarray(expert_ids)
    if ids.ndim != 2:
        raise ValueError(f"expert_ids must be [tokens, top_k], got shape {ids.shape}")
    if tile_m not in (64, 128):
        raise ValueError(f"tile_m must be 64 or 128 (the compiled grouped tiles), got {tile_m}")
    flat = ids.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got [{flat.min()}, {flat.max()}]")
    counts = np.bincount(flat, minlength=num_experts)
    tiles = -(-counts // tile_m)
    start = np.concatenate([[0], np.cumsum(tiles * tile_m)[:-1]])
    order = np.argsort(flat, kind="stable")
    rank = np.empty_like(order)
    first_of_expert = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank[order] = np.arange(flat.size) - first_of_expert[flat[order]]
    rows = (start[flat] + rank).astype(np.int32).reshape(ids.shape)
    tile_expert = np.repeat(np.arange(num_experts, dtype=np.int32), tiles)
    return ExpertGroups(tile_m, rows, tile_expert, counts)
