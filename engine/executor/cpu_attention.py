"""Causal GQA attention of one sequence's new tokens over its paged context in numpy (NumpyOps.attention).

The context's K and V sit in the pool's blocks ([blocks, BLOCK_SIZE, Hkv, D], scattered), so they must be
gathered; a whole-context gather writes the context out once more before the products read it back (at 8k
tokens of SmolLM2, 6 MB a plane and layer: memory-bound on a core). Instead the blocks are staged a group
at a time (STAGE_BYTES: a core's L2) into a buffer reused by every call, and the group's products read it
there, each kv head's keys a [tokens, D] operand of row stride Hkv·D that BLAS takes in place:
scores[h] = K[h] @ Q[h]^T for the kv head's G query heads at once (GQA: query head h·G + g reads kv head
h), and out[h] += P[h] @ V[h] over the groups. So a step costs about one read of its context, plus the
products. The scores (context-sized: [Hkv, L, G·n] as the products write them, then transposed for the
softmax's reductions along the keys) live in one buffer reused by every call too: fresh arrays of that size
are mapped and page-faulted anew each call wherever malloc serves them by mmap (glibc does until a freed one
raises its threshold: it depends on the process's history), at 8k tokens a 4-token chunk's two 1.15 MB
arrays, ~560 faults a layer, a third of its attention's CPU time.
"""
from __future__ import annotations

import numpy as np

from memory.kv_pool import BLOCK_SIZE

STAGE_BYTES = 512 * 1024      # one staged group of blocks (K or V, every kv head)
SCORES_KEEP_BYTES = 64 << 20  # a call's scores up to this size come from the kept buffer (larger: a new array)


class PagedAttention:
    """The staging buffer (one per (Hkv, D) shape), the scores' buffer and the attention over them."""

    def __init__(self) -> None:
        self._stages: dict[tuple[int, int], np.ndarray] = {}
        self._scores = np.empty(0, np.float32)

    def _scores_pair(self, heads: int, keys: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Two float32 arrays, [heads, keys, rows] and [heads, rows, keys], views of the kept buffer (grown
        as needed) unless they pass SCORES_KEEP_BYTES together."""
        size = heads * keys * rows
        if 2 * size * 4 > SCORES_KEEP_BYTES:
            flat = np.empty(2 * size, np.float32)
        else:
            if self._scores.size < 2 * size:
                self._scores = np.empty(2 * size, np.float32)
            flat = self._scores
        return flat[:size].reshape(heads, keys, rows), flat[size:2 * size].reshape(heads, rows, keys)

    def _stage(self, heads: int, dim: int) -> np.ndarray:
        key = (heads, dim)
        if key not in self._stages:
            blocks = max(1, STAGE_BYTES // (BLOCK_SIZE * heads * dim * 4))
            self._stages[key] = np.empty((blocks, BLOCK_SIZE, heads, dim), np.float32)
        return self._stages[key]

    def _groups(self, plane: np.ndarray, blocks: np.ndarray, length: int, scale: float = 1.0):
        """(first token, its [tokens, Hkv, D] keys or values) of the context, a staged group at a time; a
        pool of e4m3 bytes (the FP8 KV cache) staged as its float32 values times the plane's scale."""
        stage = self._stage(plane.shape[2], plane.shape[3])
        per = stage.shape[0]
        for j in range(0, len(blocks), per):
            m = min(per, len(blocks) - j)
            if plane.dtype == np.float32:
                np.take(plane, blocks[j:j + m], axis=0, out=stage[:m], mode="clip")
            else:
                np.copyto(stage[:m], plane[blocks[j:j + m]], casting="unsafe")
                stage[:m] *= np.float32(scale)
            t0 = j * BLOCK_SIZE
            yield t0, stage[:m].reshape(m * BLOCK_SIZE, *plane.shape[2:])[:min(length - t0, m * BLOCK_SIZE)]

    def attend(self, q: np.ndarray, k_plane: np.ndarray, v_plane: np.ndarray, blocks: np.ndarray, L: int,
               positions: np.ndarray, scale: float, kv_scales: tuple[float, float] = (1.0, 1.0)) -> np.ndarray:
        """q: float32 [n, Hq, D] at `positions` (< L); k_plane, v_plane: a layer's pool planes as [blocks,
        BLOCK_SIZE, Hkv, D] (float32, or e4m3 read as e4m3 · kv_scales); blocks: the sequence's blocks
        covering its L context tokens. Returns float32 [n, Hq, D]: each query attends to the keys up to its
        own position."""
        n, Hq, D = q.shape
        Hkv = k_plane.shape[2]
        G = Hq // Hkv
        # rows g·n + t of kv head h: query head h·G + g at token t; the scale on q (n·D products, not n·L)
        qs = (q * np.float32(scale)).reshape(n, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * n, D)
        scores_t, scores = self._scores_pair(Hkv, L, G * n)
        for t0, k in self._groups(k_plane, blocks, L, kv_scales[0]):
            np.matmul(k.transpose(1, 0, 2), qs.transpose(0, 2, 1), out=scores_t[:, t0:t0 + len(k)])
        np.copyto(scores, scores_t.transpose(0, 2, 1))                     # [Hkv, G·n, L]
        qpos = np.tile(positions, G)
        first = int(qpos.min())
        if first + 1 < L:       # the causal mask, on the keys from the chunk's first position on
            scores[:, :, first:] += np.where(np.arange(first, L)[None, :] > qpos[:, None], -np.inf,
                                             0).astype(np.float32)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        out = np.zeros((Hkv, G * n, D), np.float32)
        for t0, v in self._groups(v_plane, blocks, L, kv_scales[1]):
            out += scores[:, :, t0:t0 + len(v)] @ v.transpose(1, 0, 2)
        out /= scores.sum(axis=-1, keepdims=True)
        return out.reshape(Hkv, G, n, D).transpose(2, 0, 1, 3).reshape(n, Hq, D)
