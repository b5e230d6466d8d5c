"""The numpy executor's quantized linear layers, with the GPU kernels' numerics (the reference they are checked
against, and what CPU tests check).

FP8 W8A8 (engine/models/quant_linear.py Fp8Linear): the activations quantized per token and 128-wide group to
e4m3 with float32 scales (fp8_ref.quantize_activations: vLLM's per_token_group_quant_fp8, fp8_quant.cu), each
128-column block's product of e4m3 operands accumulated in float32 and scaled by the token's group scale and the
weight's block (or row) scale, the blocks summed in float32 (gemv_fp8.cu, the CuTe fp8_gemm's main loop).
"""
from __future__ import annotations

import numpy as np

from engine.models.quant_experts import Fp8Experts
from engine.models.quant_linear import Fp8Linear
from openinfer_kernels.quant.fp8_ref import GROUP, quantize_activations


def host_fp8(w: Fp8Linear | Fp8Experts) -> Fp8Linear | Fp8Experts:
    """w with its codes as float32 values, each [N, K] matrix column-major (each block's codes[:, block]ᵀ reads
    contiguously)."""
    codes = np.asarray(w.codes).astype(np.float32)
    return type(w)(np.ascontiguousarray(codes.swapaxes(-1, -2)).swapaxes(-1, -2), w.scale)


def w8a8_linear(x: np.ndarray, w: Fp8Linear) -> np.ndarray:
    """y [M, N] float32 = the W8A8 product of x (float32 [M, K]) and w."""
    M, K = x.shape
    N = w.shape[0]
    if K != w.shape[1]:
        raise ValueError(f"x [{M}, {K}] does not match an FP8 weight {list(w.shape)}")
    q, s = quantize_activations(x)
    q = q.astype(np.float32)
    codes = w.codes if w.codes.dtype == np.float32 else np.asarray(w.codes).astype(np.float32)
    per_k = None if w.channel else w.scale_per_k()                            # [N, K/128]
    y = np.zeros((M, N), np.float32)
    for kb in range(K // GROUP):
        cols = slice(kb * GROUP, (kb + 1) * GROUP)
        scale = s[kb, :M, None] if per_k is None else s[kb, :M, None] * per_k[None, :, kb]
        y += (q[:, cols] @ codes[:, cols].T) * scale
    return y * w.scale[None, :] if per_k is None else y
