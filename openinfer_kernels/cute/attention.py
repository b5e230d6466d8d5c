"""Launcher for ``attention_ws_sm90`` / ``attention_sm90``: varlen causal prefill attention, GQA,
head_dim 128 or 64.

Several compiled kernels compute the same thing with the same arguments (``ATTENTION_VARIANTS``):
``varlen_attention_ws*`` (FlashAttention-3 schedule: a TMA producer warpgroup and two ping-ponging
consumer warpgroups; ``_d64`` is head_dim 64, ``_persistent`` runs one CTA per SM over the work
items, ``_overlap`` adds P·V / softmax overlap inside each consumer) and ``varlen_attention`` (the
FlashAttention-2 schedule, head_dim 128, the fallback). ``DEFAULT_KERNEL`` maps a head dim to the kernel used unless a caller (the
verification, the benchmark) names one through ``kernel=``; only kernels verified on the H200 and
fastest there are defaults (bench/results/kernels.md).

``q``/``o`` are ``[tokens_q, Hq, D]`` and ``k``/``v`` ``[tokens_k, Hkv, D]`` bf16 (uint16 in CuPy)
with contiguous heads; ``cu_q``/``cu_k`` the int32 ``[B+1]`` prefix sums of the lengths; ``work``
the int32 ``[tiles, 2]`` list from ``attention_work`` (host-built, like cu_q). The softmax scale is
``1/sqrt(D)``. All of these live on the device; the call is graph-capturable. The kernel trusts the
contents of ``cu_q``/``cu_k``/``work``: they must be ready on ``stream`` (copied on it, or waited
for) — read early, garbage lengths make each CTA loop over millions of key tiles (TMA loads out of
range never fault), which looks like a hang. That was the 16k-token benchmark "hang" of the
2026-11-30 H200 run: its inputs were made on the default stream and the kernel launched on a
non-blocking one; with ``bench/kernels.py`` syncing first, 16k runs (2026-12-01).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gemm import DeviceTensor, _stream_ptr, as_device_tensor
from .library import TensorArg

TILE_Q = 128  # query rows of one work-list tile (the FA2 kernel runs it as two 64-row CTAs)


@dataclass(frozen=True)
class AttentionVariant:
    """One compiled attention kernel: its symbol name, schedule, head dim and K/V ring depth."""

    name: str
    schedule: str  # "ws" | "ws_overlap" | "ws_persistent" (attention_ws_sm90) | "fa2" (attention_sm90)
    head_dim: int = 128
    kv_stages: int = 2


ATTENTION_VARIANTS = (  # every one verified on the H200 (2026-12-01); the ws ones: 8 cases each
    AttentionVariant("varlen_attention_ws", "ws"),
    AttentionVariant("varlen_attention_ws_d64", "ws", head_dim=64, kv_stages=4),
    AttentionVariant("varlen_attention_ws_persistent", "ws_persistent"),
    AttentionVariant("varlen_attention_ws_overlap", "ws_overlap"),
    AttentionVariant("varlen_attention", "fa2", kv_stages=3),
)
ATTENTION_BY_NAME = {v.name: v for v in ATTENTION_VARIANTS}
ATTENTION_KERNELS = tuple(ATTENTION_BY_NAME)
HEAD_DIMS = (128, 64)
# H200 2026-12-01 (bench/results/kernels.md): the plain ping-pong kernel is the fastest verified one at
# 1k / 4k / 16k for both head dims (1.25-1.6x the FA2 kernel at 128); persistent, intra-warpgroup
# overlap and 3-stage variants were verified too and measured slower.
DEFAULT_KERNEL = {128: "varlen_attention_ws", 64: "varlen_attention_ws_d64"}


def attention_work(cu_seqlens_q: np.ndarray) -> np.ndarray:
    """``[(sequence, 128-row query tile)]`` for every tile, longest sequences first, int32."""
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError("cu_seqlens_q must be a non-decreasing 1-D prefix sum starting at 0")
    lengths = np.diff(cu)
    tiles = -(-lengths // TILE_Q)
    order = np.argsort(-lengths, kind="stable")
    seqs = np.repeat(order, tiles[order])
    # within a sequence, the later (more expensive, causal) tiles first
    firsts = np.concatenate([np.arange(t - 1, -1, -1) for t in tiles[order]]) if seqs.size else seqs
    return np.stack([seqs, firsts], axis=1).astype(np.int32)


def _check_heads(t: DeviceTensor, what: str, head_dim: int) -> tuple[int, int]:
    if t.dtype != "bfloat16":
        raise TypeError(f"{what} must be bfloat16 (uint16 in CuPy), got {t.dtype}")
    if len(t.shape) != 3 or t.shape[2] != head_dim:
        raise ValueError(f"{what} must be [tokens, heads, {head_dim}], got shape {t.shape}")
    if t.strides[2] != 1 or (t.shape[1] > 1 and t.strides[1] != head_dim):
        raise ValueError(f"{what} heads must be contiguous [heads, {head_dim}] rows, got strides {t.strides}")
    if t.shape[0] > 1 and t.strides[0] % 8 or t.ptr % 16:
        raise ValueError(f"{what} must be 16-byte aligned (address and row stride)")
    return t.shape[0], t.shape[1]


def _check_int32(t: DeviceTensor, what: str, shape_len: int) -> None:
    if t.dtype != "int32" or len(t.shape) != shape_len:
        raise TypeError(f"{what} must be a {shape_len}-D int32 device array, got {t.dtype} {t.shape}")


def check_attention_args(q, k, v, o, cu_q, cu_k, work) -> int:
    """Validate shapes, dtypes, strides and alignment (contents are trusted); return the head dim."""
    head_dim = q.shape[2] if len(q.shape) == 3 and q.shape[2] in HEAD_DIMS else HEAD_DIMS[0]
    tq, hq = _check_heads(q, "q", head_dim)
    tk, hkv = _check_heads(k, "k", head_dim)
    if _check_heads(v, "v", head_dim) != (tk, hkv) or v.strides != k.strides:
        raise ValueError(f"v must match k: shapes {v.shape} vs {k.shape}, strides {v.strides} vs {k.strides}")
    if _check_heads(o, "o", head_dim) != (tq, hq) or o.strides[0] != q.strides[0]:
        raise ValueError(f"o must match q: shapes {o.shape} vs {q.shape}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {hkv}")
    _check_int32(cu_q, "cu_q", 1)
    _check_int32(cu_k, "cu_k", 1)
    if cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_q and cu_k must both be [batch + 1], got {cu_q.shape} and {cu_k.shape}")
    _check_int32(work, "work", 2)
    if work.shape[1] != 2 or work.shape[0] < 1 or work.strides != (2, 1):
        raise ValueError(f"work must be a contiguous [tiles, 2] list (attention_work), got {work.shape}")
    return head_dim


def varlen_attention(runner, q, k, v, o, cu_q, cu_k, work, stream=None, kernel: str | None = None) -> None:
    """Causal attention of every sequence in one launch; see the module docstring."""
    if kernel is not None and kernel not in ATTENTION_BY_NAME:
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {ATTENTION_KERNELS}")
    q, k, v, o = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o")))
    cu_q, cu_k, work = (as_device_tensor(x, n) for x, n in ((cu_q, "cu_q"), (cu_k, "cu_k"), (work, "work")))
    head_dim = check_attention_args(q, k, v, o, cu_q, cu_k, work)
    if kernel is None:
        if head_dim not in DEFAULT_KERNEL:
            raise ValueError(f"no attention kernel verified for head_dim {head_dim} (have {sorted(DEFAULT_KERNEL)})")
        kernel = DEFAULT_KERNEL[head_dim]
    if ATTENTION_BY_NAME[kernel].head_dim != head_dim:
        raise ValueError(f"attention kernel {kernel} is for head_dim {ATTENTION_BY_NAME[kernel].head_dim}, "
                         f"the tensors have {head_dim}")
    runner.ensure_loaded()
    (tq, hq), (tk, hkv) = q.shape[:2], k.shape[:2]
    row_q, row_k = max(q.strides[0], hq * head_dim), max(k.strides[0], hkv * head_dim)
    runner.library[kernel](
        TensorArg(q.ptr, (tq, hq), (row_q,)),
        TensorArg(k.ptr, (tk, hkv), (row_k,)),
        TensorArg(v.ptr, (tk, hkv), (row_k,)),  # viewed as vᵀ: (D, tokens, heads)
        TensorArg(o.ptr, (tq, hq), (row_q,)),
        TensorArg(cu_q.ptr, (cu_q.shape[0],), ()),
        TensorArg(cu_k.ptr, (cu_k.shape[0],), ()),
        TensorArg(work.ptr, (work.shape[0],), ()),
        stream=_stream_ptr(stream))
