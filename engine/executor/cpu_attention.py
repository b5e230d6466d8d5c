"""Causal GQA attention of one sequence's new tokens over its paged context in numpy (NumpyOps.attention).

The context's K and V sit in the pool's blocks ([blocks, BLOCK_SIZE, Hkv, D], scattered), so they must be
gathered; a whole-context gather writes the context out once more before the products read it back (at 8k
tokens of SmolLM2, 6 MB a plane and layer: memory-bound on a core). Instead the blocks are staged a group
at a time (STAGE_BYTES: a core's L2) into a buffer reused by every call, and the group's products read it
there, each kv head's keys a [tokens, D] operand of row stride Hkv·D that BLAS takes in place: a group's
scores[h] = Q[h] @ K[h]^T for the kv head's G query heads at once (GQA: query head h·G + g reads kv head
h), masked, and their row maxima; then, a group at a time again, its scores less the row's maximum
exponentiated in place, their sums and P[h] @ V[h], the groups' sums and products added in the groups'
order. So a step costs about one read of its context, plus the products.

A context of PARALLEL_KEYS keys or more splits over the workers (engine/executor/cpu_workers.py): the
groups' key products, the softmax's rows, the groups' value products, each part in its own staging buffer.
Every number is computed by the same operation whichever worker runs it, so the result does not depend on
the number of workers.
"""
from __future__ import annotations

import numpy as np

from engine.executor.cpu_workers import Workers, share
from memory.kv_pool import BLOCK_SIZE

STAGE_BYTES = 512 * 1024      # one staged group of blocks (K or V, every kv head)
PARALLEL_KEYS = 1024          # a context this long splits over the workers


class PagedAttention:
    """The staging buffers (one per worker and (Hkv, D) shape) and the attention over them."""

    def __init__(self, workers: Workers | None = None) -> None:
        self.workers = workers or Workers(1)
        self._stages: dict[tuple[int, int, int], np.ndarray] = {}

    def _per_group(self, heads: int, dim: int) -> int:
        return max(1, STAGE_BYTES // (BLOCK_SIZE * heads * dim * 4))

    def _stage(self, worker: int, heads: int, dim: int) -> np.ndarray:
        key = (worker, heads, dim)
        if key not in self._stages:       # each worker's own; made before the parts run (no race on the dict)
            self._stages[key] = np.empty((self._per_group(heads, dim), BLOCK_SIZE, heads, dim), np.float32)
        return self._stages[key]

    def _staged(self, stage: np.ndarray, plane: np.ndarray, blocks: np.ndarray, length: int, group: int,
                scale: float) -> tuple[int, np.ndarray]:
        """(first token, its [tokens, Hkv, D] keys or values) of the context's group `group`, staged; a pool
        of e4m3 bytes (the FP8 KV cache) staged as its float32 values times the plane's scale."""
        per = stage.shape[0]
        j = group * per
        m = min(per, len(blocks) - j)
        if plane.dtype == np.float32:
            np.take(plane, blocks[j:j + m], axis=0, out=stage[:m], mode="clip")
        else:
            np.copyto(stage[:m], plane[blocks[j:j + m]], casting="unsafe")
            stage[:m] *= np.float32(scale)
        t0 = j * BLOCK_SIZE
        return t0, stage[:m].reshape(m * BLOCK_SIZE, *plane.shape[2:])[:min(length - t0, m * BLOCK_SIZE)]

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
        groups = -(-len(blocks) // self._per_group(Hkv, D))
        parts = min(self.workers.count if L >= PARALLEL_KEYS else 1, groups)
        stages = [self._stage(w, Hkv, D) for w in range(parts)]
        qpos = np.tile(positions, G)                                  # each row's query position
        scores = np.empty((Hkv, G * n, L), np.float32)
        peak = np.empty((groups, Hkv, G * n, 1), np.float32)          # each group's row maxima, then sums
        partial = np.empty((groups, Hkv, G * n, D), np.float32)

        def keys(w: int) -> None:       # a group's scores (masked past each query), their row maxima
            for g in share(groups, w, parts):
                t0, k = self._staged(stages[w], k_plane, blocks, L, g, kv_scales[0])
                s = scores[:, :, t0:t0 + len(k)]
                np.matmul(qs, k.transpose(1, 2, 0), out=s)
                if t0 + len(k) > qpos.min() + 1:
                    s += np.where(np.arange(t0, t0 + len(k)) > qpos[:, None], -np.inf, 0).astype(np.float32)
                np.max(s, axis=-1, keepdims=True, out=peak[g])

        def values(w: int) -> None:     # a group's exponentials (less the row's max), their sums, P @ V
            for g in share(groups, w, parts):
                t0, v = self._staged(stages[w], v_plane, blocks, L, g, kv_scales[1])
                s = scores[:, :, t0:t0 + len(v)]
                s -= top
                np.exp(s, out=s)
                np.sum(s, axis=-1, keepdims=True, out=peak[g])
                np.matmul(s, v.transpose(1, 0, 2), out=partial[g])

        self.workers.run(keys, parts)
        top = peak.max(axis=0)
        self.workers.run(values, parts)
        out, sums = partial[0], peak[0]
        for g in range(1, groups):      # in the groups' order, whichever worker made them
            out += partial[g]
            sums += peak[g]
        out /= sums
        return out.reshape(Hkv, G, n, D).transpose(2, 0, 1, 3).reshape(n, Hq, D)
