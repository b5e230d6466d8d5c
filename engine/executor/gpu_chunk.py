"""Short query runs over long paged contexts on tensor cores (openinfer_kernels/raw_cuda/paged_chunk.cu).

A sequence that feeds a few tokens at once after a long cached prefix (a prefix hit's recomputed last
block, a short chunk) was served by paged_decode.cu, which walks the whole context once per query
row on CUDA cores: a 16-token prefix hit at 16k context took ~13 ms of GPU time (Qwen3-4B, 36 layers),
where reading its K and V once takes ~0.6 ms. paged_chunk.cu stages each K/V tile once for 64 query
rows (the run's tokens × the GQA heads of one KV head) and scores them with mma.sync, split over the
keys so a single run fills the GPU.

Here: which sequences it serves (2 <= new tokens < the CuTe kernel's minimum), their tiles of
64 / GQA tokens ([tiles, 2] int32: first row, rows), the split count, and the launches. The plan and
upload ride with gpu_prefill.PrefillPlan; rows it serves are -1 in the paged kernel's positions.
"""
from __future__ import annotations

import numpy as np

from openinfer_kernels.raw_cuda import kernel
from openinfer_kernels.raw_cuda.launch import launch

CHUNK_ROWS = 64             # query rows per CTA (paged_chunk.cu ROWS)
MIN_CHUNK_TOKENS = 2        # one-token rows (decodes) stay on paged_decode.cu
SPLIT_KEYS = 256            # no split shorter than this many keys
CTAS_PER_SM = 3             # CTAs an SM holds at once (paged_chunk.cu __launch_bounds__): splits fill one wave
MAX_CHUNK_SPLITS = 64


def chunk_fits(group: int, head_dim: int) -> bool:
    """paged_chunk.cu's shapes: GQA divides 64, head_dim a multiple of 16 up to 128."""
    return 0 < group <= CHUNK_ROWS and CHUNK_ROWS % group == 0 and head_dim % 16 == 0 and 16 <= head_dim <= 128


def tile_tokens(group: int) -> int:
    return CHUNK_ROWS // group


def chunk_tiles(cu_seqlens: np.ndarray, served: np.ndarray, tokens: int) -> np.ndarray:
    """[tiles, 2] int32 (first row, rows) covering the new tokens of each served sequence, `tokens` a tile."""
    out = []
    for b in np.flatnonzero(served).tolist():
        a, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        out.extend((t, min(tokens, e - t)) for t in range(a, e, tokens))
    return np.asarray(out, np.int32).reshape(-1, 2)


def chunk_splits(tiles: int, tokens: int, num_kv_heads: int, max_context: int, capacity: int, num_sms: int) -> int:
    """KV splits: as many as one wave of CTAS_PER_SM CTAs per SM holds (a second, partial wave would double
    the time: each CTA's walk is latency-bound), none shorter than SPLIT_KEYS keys, and the partials
    (tiles · tokens · S query rows of every head) within the `capacity` rows GpuOps' buffers hold."""
    want = CTAS_PER_SM * num_sms // max(1, tiles * num_kv_heads)
    s = min(MAX_CHUNK_SPLITS, want, -(-max_context // SPLIT_KEYS), capacity // max(1, tiles * tokens))
    return max(1, s)


class ChunkKernel:
    """paged_chunk.cu compiled for one (GQA, head_dim); `launch` runs it (and the merge) over a plan's tiles."""

    def __init__(self, group: int, head_dim: int, stream):
        self.group, self.head_dim, self.stream = group, head_dim, stream
        self.tokens = tile_tokens(group)
        self.attend = kernel("paged_chunk", "paged_chunk_attention", GQA=group, HEAD_DIM=head_dim)
        self.merge = kernel("paged_chunk", "paged_chunk_merge", GQA=group, HEAD_DIM=head_dim)
        self.launches = 0           # attention launches so far (tests check the path ran)

    def launch(self, ops, q, spec, ctx, out, tiles, num_tiles: int, max_context: int) -> None:
        """out rows of the tiles' tokens = their attention over the paged cache (q [T, Hq, D], out [T, Hq·D])."""
        Hkv, sh = spec.num_kv_heads, ops.shared
        S = chunk_splits(num_tiles, self.tokens, Hkv, max_context, sh.max_tokens + 2 * sh.num_sms, sh.num_sms)
        kc, vc = sh.kv_cache[spec.layer, 0], sh.kv_cache[spec.layer, 1]
        launch(self.attend, (num_tiles, S, Hkv), (128,),
               (q, kc, vc, ctx.block_tables, np.int32(ctx.block_tables.shape[1]), ctx.token_seq, ctx.positions,
                tiles, ops.part_out, ops.part_max, ops.part_sum, out, np.int32(Hkv), np.float32(spec.scale)),
               self.stream)
        if S > 1:
            launch(self.merge, (num_tiles * self.tokens, spec.num_heads), (128,),
                   (tiles, ops.part_out, ops.part_max, ops.part_sum, out, np.int32(Hkv), np.int32(S)), self.stream)
        self.launches += 1
