"""The paged KV pool: what a model line stores per token (its KVLayout), the pool's shape and block
size, and how many blocks a memory budget holds. The CPU and GPU executors, the host KV tier and the
block manager all work from the same declaration, so a model line with its own KV (MLA's one latent
vector per token, a hybrid line whose linear-attention layers keep none) changes nothing here.

Pool layout, one array on either executor: kv[layers, planes, num_blocks * BLOCK_SIZE, heads, dim].
Token p of a sequence lives in slot block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE of
every (layer, plane). One block's KV is layers * planes equal "chunks" of BLOCK_SIZE * heads * dim
values, evenly spaced: the host tier copies a run of blocks as one strided copy (host_kv_copy.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_SIZE = 16                 # tokens per KV block (and per prefix-cache hash)


@dataclass(frozen=True)
class KVLayout:
    """What one token stores in the paged pool, declared by the model line (`kv_layout()`).

    layers: layers with paged KV (an attention layer's AttentionSpec.layer is its index here; a
    linear-attention layer has none). planes: 2 (K and V) for MHA / GQA, 1 for MLA (the compressed
    latent and the rope key in one vector). heads, dim: per plane (MLA: 1 head of kv_lora_rank +
    qk_rope_head_dim values)."""
    layers: int
    planes: int
    heads: int
    dim: int

    def __post_init__(self):
        if min(self.layers, self.planes, self.heads, self.dim) < 1:
            raise ValueError(f"KV layout needs positive sizes, got {self}")

    @property
    def token_values(self) -> int:
        """Values one token stores across every layer and plane."""
        return self.layers * self.planes * self.heads * self.dim

    def block_bytes(self, itemsize: int) -> int:
        return BLOCK_SIZE * self.token_values * itemsize

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        return (self.layers, self.planes, num_blocks * BLOCK_SIZE, self.heads, self.dim)


def blocks_for(num_tokens: int) -> int:
    """KV blocks that hold num_tokens tokens."""
    return -(-num_tokens // BLOCK_SIZE)


def pool_blocks(layout: KVLayout, itemsize: int, budget_bytes: int) -> int:
    """How many blocks fit budget_bytes (at least 0)."""
    return max(0, int(budget_bytes) // layout.block_bytes(itemsize))


def block_view(plane: np.ndarray) -> np.ndarray:
    """One (layer, plane) of a pool, [slots, heads, dim], as [blocks, BLOCK_SIZE, heads, dim]."""
    return plane.reshape(-1, BLOCK_SIZE, *plane.shape[1:])


def host_pool(layout: KVLayout, num_blocks: int, dtype=np.float32) -> np.ndarray:
    """A zeroed pool in host memory (the CPU executor's KV, or its host tier's slots)."""
    return np.zeros(layout.pool_shape(num_blocks), dtype)
