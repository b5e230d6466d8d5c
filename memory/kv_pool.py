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


def check_block_copies(pairs: np.ndarray, num_blocks: int) -> None:
    """A step's block copies (batch.py ModelBatch.block_copies: int [C, 2] of (src, dst)) stay inside the pool
    and never copy a block onto itself."""
    if pairs.size and (int(pairs.min()) < 0 or int(pairs.max()) >= num_blocks):
        raise ValueError(f"block copy {pairs.tolist()} outside the KV pool ({num_blocks} blocks)")
    if pairs.size and bool((pairs[:, 0] == pairs[:, 1]).any()):
        raise ValueError(f"block copy {pairs.tolist()} copies a block onto itself")


def copy_pool_blocks(pool, pairs: np.ndarray) -> None:
    """Block dst takes block src's KV in every (layer, plane), pair by pair, for a pool
    [layers, planes, slots, heads, dim] (numpy, or CuPy on the current stream: one strided copy kernel
    per pair, ~2.3 MB for a Qwen3-4B block, ~1 us of HBM time)."""
    blocks = pool.reshape(*pool.shape[:2], -1, BLOCK_SIZE * pool.shape[3] * pool.shape[4])
    for src, dst in pairs.tolist():
        blocks[:, :, dst] = blocks[:, :, src]


def host_pool(layout: KVLayout, num_blocks: int, dtype=np.float32) -> np.ndarray:
    """A zeroed pool in host memory (the CPU executor's KV, or its host tier's slots)."""
    return np.zeros(layout.pool_shape(num_blocks), dtype)
