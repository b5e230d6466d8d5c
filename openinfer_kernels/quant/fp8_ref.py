"""numpy references of the W8A8 FP8 path (raw_cuda/fp8_quant.cu, raw_cuda/gemv_fp8.cu, the CuTe FP8 GEMM).

Activations are quantized per token and 128-wide group as vLLM's per_token_group_quant_fp8 does:
``s = max(amax, 1e-10) / 448`` (float32), ``q = e4m3(clip(x / s, ±448))`` (IEEE division, nearest even);
the scales are stored MN-major, ``s[kb, m]`` (DeepGEMM's layout). Weights are e4m3 with float32 scales per
[128, 128] block (``weight_scale_inv``, quant_method fp8) or per output row. The W8A8 product is
``y[m, n] = sum_kb sw(n, kb) · s[kb, m] · sum_k q[m, k] · w[n, k]``: ``w8a8_exact`` computes it in float64
(the e4m3 products are exact), the kernels in float32 from the same e4m3 operands. ``error_floor`` is what
the activation quantization alone costs against the float product with the dequantized weights: the GPU
gate of the kernels is a bound set from it (tests/kernels/test_gpu_quant_kernels.py).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
GROUP = 128
EPS = 1e-10


def quantize_activations(x: np.ndarray, ld: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] (float32 holding bf16 values) -> (q e4m3 [M, K], s float32 [K / 128, ld]) with s[:, :M] set."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    if K % GROUP:
        raise ValueError(f"K = {K} is not a multiple of {GROUP}")
    g = x.reshape(M, K // GROUP, GROUP)
    s = (np.maximum(np.abs(g).max(-1), np.float32(EPS)) / np.float32(E4M3_MAX)).astype(np.float32)   # [M, KB]
    q = np.clip(g / s[..., None], -E4M3_MAX, E4M3_MAX).astype(E4M3).reshape(M, K)
    scales = np.zeros((K // GROUP, ld or M), np.float32)
    scales[:, :M] = s.T
    return q, scales


def weight_scale_per_k(ws: np.ndarray, n: int, k: int, channel: bool) -> np.ndarray:
    """The weight scale of every (row, 128-block), float64 [N, K / 128]: a block row's scale (block scales
    [ceil(N/128), K/128]) or the row's own (channel scales [N])."""
    ws = np.asarray(ws, np.float64)
    if channel:
        return np.repeat(ws.reshape(n, 1), k // GROUP, axis=1)
    return np.repeat(ws, GROUP, axis=0)[:n]


def w8a8_exact(q: np.ndarray, s: np.ndarray, w: np.ndarray, ws: np.ndarray, channel: bool = False) -> np.ndarray:
    """The W8A8 product [M, N] in float64 from e4m3 q [M, K] with scales s [K/128, >= M] and e4m3 w [N, K]
    with scales ws (blocks or channels)."""
    M, K = q.shape
    N = w.shape[0]
    qf, wf = q.astype(np.float64), w.astype(np.float64)
    s, wsk = np.asarray(s, np.float64)[:, :M], weight_scale_per_k(ws, N, K, channel)
    out = np.zeros((M, N))
    for b in range(K // GROUP):          # one BLAS product a block, exact: small integers · powers of 2
        cols = slice(b * GROUP, (b + 1) * GROUP)
        out += (qf[:, cols] @ wf[:, cols].T) * s[b][:, None] * wsk[:, b][None, :]
    return out


def dequant_weight(w: np.ndarray, ws: np.ndarray, channel: bool = False) -> np.ndarray:
    """e4m3 w [N, K] times its scales, float64."""
    N, K = w.shape
    return w.astype(np.float64) * np.repeat(weight_scale_per_k(ws, N, K, channel), GROUP, axis=1)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """Relative Frobenius error."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


def error_floor(x: np.ndarray, w: np.ndarray, ws: np.ndarray, channel: bool = False) -> float:
    """The relative error of the exact W8A8 product against x · dequant(w)ᵀ (x unquantized): the activation
    quantization's own cost, which no kernel on these operands can go below."""
    q, s = quantize_activations(x)
    reference = np.asarray(x, np.float64) @ dequant_weight(w, ws, channel).T
    return relative_error(w8a8_exact(q, s, w, ws, channel), reference)
