"""Launcher for ``attention_ws_sm90`` / ``attention_sm90``: varlen causal prefill attention, GQA, head_dim 128.

Three kernels compute the same thing with the same arguments: ``varlen_attention_ws`` (FlashAttention-3
schedule: producer warpgroup + two ping-ponging consumer warpgroups), ``varlen_attention_ws_overlap``
(the same, plus P·V / softmax overlap inside each consumer) and ``varlen_attention`` (the
FlashAttention-2 schedule, the fallback). ``ATTENTION_KERNEL`` names the one used by default; a
caller (the verification, the benchmark) may name either through ``kernel=``.

``q``/``o`` are ``[tokens_q, Hq, 128]`` and ``k``/``v`` ``[tokens_k, Hkv, 128]`` bf16 (uint16 in
CuPy) with contiguous heads; ``cu_q``/``cu_k`` the int32 ``[B+1]`` prefix sums of the lengths;
``work`` the int32 ``[tiles, 2]`` list from ``attention_work`` (host-built, like cu_q). The softmax
scale is ``1/sqrt(128)``. All of these live on the device; the call is graph-capturable. The kernel
trusts the contents of ``cu_q``/``cu_k``/``work``: they must be ready on ``stream`` (copied on it, or
waited for) — read early, garbage lengths make each CTA loop over millions of key tiles (TMA loads
out of range never fault), which looks like a hang.

16k-token benchmark hang (H200 run of 2026-11-30), diagnosed without a GPU:
1. Most likely, fixed in ``bench/kernels.py`` (3050d09): the benchmark made its inputs on the default
   stream and launched on a non-blocking stream that is not ordered after it. At 16k the
   ``cu``/``work`` copies sat behind an estimated ~2 ms of random-input generation (~0.5 ms at 4k),
   so the kernel read stale pool memory as sequence lengths (verification runs on one stream; the
   4k row's window was narrower). ``tests/test_cute.py`` models the ordering.
2. Ruled out by reading the kernel and its PTX: output addressing is 64-bit (``mad.lo.s64``); TMA
   coordinates are ≤ tokens (int32); grid (256, 32); 64 KiB transaction count per stage (< 2^20);
   the ring's phase flips every 3 tiles with no bound on the tile count; shared memory (209 KiB)
   and wgmma descriptors do not depend on length.
3. Untested until the next GPU run: the kernel itself beyond 32 key tiles (the longest verified
   case had 4096 keys). Cases 78/79 of ``testing.CASES`` (8k with a cached prefix, 16k at 32/8
   heads) decide it, on one stream, with the benchmark row after them:
   ``python -m kernels.cute.build && python -m kernels.cute.verify --worker 78,79 &&
   python bench/kernels.py --worker 1,2,3 --ok varlen_attention --no-sweep``
   (79 HANG → the kernel; 79 PASS and row 3 HANG → the benchmark still races).
"""
from __future__ import annotations

import numpy as np

from .gemm import DeviceTensor, _stream_ptr, as_device_tensor
from .library import TensorArg

HEAD_DIM = 128
TILE_Q = 128  # query rows of one work-list tile (the FA2 kernel runs it as two 64-row CTAs)
ATTENTION_NAME = "varlen_attention"
ATTENTION_WS_NAME = "varlen_attention_ws"
ATTENTION_WS_OVERLAP_NAME = "varlen_attention_ws_overlap"
ATTENTION_KERNELS = (ATTENTION_WS_NAME, ATTENTION_WS_OVERLAP_NAME, ATTENTION_NAME)
ATTENTION_KERNEL = ATTENTION_WS_NAME  # H200 2026-12-01: verified, 1.25-1.6x the FA2 kernel (bench/results/kernels.md)


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


def _check_heads(t: DeviceTensor, what: str) -> tuple[int, int]:
    if t.dtype != "bfloat16":
        raise TypeError(f"{what} must be bfloat16 (uint16 in CuPy), got {t.dtype}")
    if len(t.shape) != 3 or t.shape[2] != HEAD_DIM:
        raise ValueError(f"{what} must be [tokens, heads, {HEAD_DIM}], got shape {t.shape}")
    if t.strides[2] != 1 or (t.shape[1] > 1 and t.strides[1] != HEAD_DIM):
        raise ValueError(f"{what} heads must be contiguous [heads, {HEAD_DIM}] rows, got strides {t.strides}")
    if t.shape[0] > 1 and t.strides[0] % 8 or t.ptr % 16:
        raise ValueError(f"{what} must be 16-byte aligned (address and row stride)")
    return t.shape[0], t.shape[1]


def _check_int32(t: DeviceTensor, what: str, shape_len: int) -> None:
    if t.dtype != "int32" or len(t.shape) != shape_len:
        raise TypeError(f"{what} must be a {shape_len}-D int32 device array, got {t.dtype} {t.shape}")


def check_attention_args(q, k, v, o, cu_q, cu_k, work) -> None:
    """Validate shapes, dtypes, strides and alignment (contents are trusted)."""
    tq, hq = _check_heads(q, "q")
    tk, hkv = _check_heads(k, "k")
    if _check_heads(v, "v") != (tk, hkv) or v.strides != k.strides:
        raise ValueError(f"v must match k: shapes {v.shape} vs {k.shape}, strides {v.strides} vs {k.strides}")
    if _check_heads(o, "o") != (tq, hq) or o.strides[0] != q.strides[0]:
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


def varlen_attention(runner, q, k, v, o, cu_q, cu_k, work, stream=None, kernel: str | None = None) -> None:
    """Causal attention of every sequence in one launch; see the module docstring."""
    kernel = kernel or ATTENTION_KERNEL
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {ATTENTION_KERNELS}")
    q, k, v, o = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o")))
    cu_q, cu_k, work = (as_device_tensor(x, n) for x, n in ((cu_q, "cu_q"), (cu_k, "cu_k"), (work, "work")))
    check_attention_args(q, k, v, o, cu_q, cu_k, work)
    runner.ensure_loaded()
    (tq, hq), (tk, hkv) = q.shape[:2], k.shape[:2]
    row_q, row_k = max(q.strides[0], hq * HEAD_DIM), max(k.strides[0], hkv * HEAD_DIM)
    runner.library[kernel](
        TensorArg(q.ptr, (tq, hq), (row_q,)),
        TensorArg(k.ptr, (tk, hkv), (row_k,)),
        TensorArg(v.ptr, (tk, hkv), (row_k,)),  # viewed as vᵀ: (128, tokens, heads)
        TensorArg(o.ptr, (tq, hq), (row_q,)),
        TensorArg(cu_q.ptr, (cu_q.shape[0],), ()),
        TensorArg(cu_k.ptr, (cu_k.shape[0],), ()),
        TensorArg(work.ptr, (work.shape[0],), ()),
        stream=_stream_ptr(stream))
