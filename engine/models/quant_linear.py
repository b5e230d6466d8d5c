"""A linear layer's weight kept quantized: what a model line passes to ops.linear (and the fused linear ops)
in place of a dense [N, K] array when the checkpoint (or --quantization) quantizes the layer. The lines never
look inside: each executor's linear op serves it on its own kernel (numpy: an emulation of the GPU's numerics).

FP8 W8A8 (vLLM's quant_method fp8 and compressed-tensors float-quantized): e4m3 codes [N, K] with float32
scales, either per [128, 128] block ([ceil(N/128), K/128], `weight_scale_inv`) or per output row ([N]:
compressed-tensors' channel scales, a tensor scale repeated, and `--quantization fp8`'s own). The activations
are quantized on the fly per token and 128-wide group (openinfer_kernels/quant/fp8_ref.py), so K must be a
multiple of 128.

INT4 W4A16 (AWQ gemm version, GPTQ without act-order, compressed-tensors pack-quantized int4): W4Linear, the codes
kept packed; the activations stay bf16, the products are exact to the dequantized weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from openinfer_kernels.quant.fp8_ref import E4M3, E4M3_MAX, GROUP, weight_scale_per_k
from openinfer_kernels.quant.w4_formats import SYMMETRIC_ZERO, W4Codes, dequant


@dataclass(frozen=True, eq=False)
class Fp8Linear:
    """codes: e4m3 values [N, K] (as e4m3, or float32 holding them: the numpy executor's copy);
    scale: float32 [ceil(N/128), K/128] (block scales) or [N] (channel scales)."""
    codes: np.ndarray
    scale: np.ndarray

    def __post_init__(self):
        N, K = self.codes.shape
        block = (-(-N // GROUP), K // GROUP)
        if K % GROUP:
            raise ValueError(f"FP8 W8A8 needs K a multiple of {GROUP}, got a weight [{N}, {K}]")
        if self.scale.dtype != np.float32 or self.scale.shape not in ((N,), block):
            raise ValueError(f"FP8 weight [{N}, {K}] needs float32 scales [{N}] or {list(block)}, "
                             f"got {self.scale.dtype} {list(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    ndim = 2

    @property
    def size(self) -> int:
        return int(self.codes.size)

    @property
    def nbytes(self) -> int:
        """What the device keeps: one byte a weight and the scales."""
        return int(self.codes.size) + int(self.scale.nbytes)

    @property
    def channel(self) -> bool:
        return self.scale.ndim == 1

    def describe(self) -> str:
        return "fp8 e4m3, per-channel scales" if self.channel else f"fp8 e4m3, {GROUP}x{GROUP} block scales"

    def scale_per_k(self) -> np.ndarray:
        """float32 [N, K/128]: the scale of every (row, 128-column block)."""
        return weight_scale_per_k(self.scale, *self.shape, self.channel).astype(np.float32)

    def dequantized(self, dtype=np.float32) -> np.ndarray:
        """codes · scale in float32 (transformers' Fp8Dequantize for block scales), as `dtype`."""
        w = np.asarray(self.codes).astype(np.float32)
        return (w * np.repeat(self.scale_per_k(), GROUP, axis=1)).astype(dtype, copy=False)

    def __array__(self, dtype=None, copy=None):
        return self.dequantized(np.float32 if dtype is None else dtype)


def fp8_concat(parts: list[Fp8Linear]) -> Fp8Linear | None:
    """The parts stacked along N (a fused qkv / gate_up), or None where block scales cannot stack (a part
    before the last whose rows are not whole 128-row blocks) or the parts mix scale kinds."""
    if len(parts) == 1:
        return parts[0]
    if len({p.channel for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
        return None
    if not parts[0].channel and any(p.shape[0] % GROUP for p in parts[:-1]):
        return None
    return Fp8Linear(np.concatenate([np.asarray(p.codes) for p in parts]),
                     np.concatenate([p.scale for p in parts]))


def fp8_per_channel(w: np.ndarray) -> Fp8Linear:
    """A bf16 / float weight [N, K] quantized per output row (vLLM's --quantization fp8 weights on Hopper):
    scale = max(amax, tiny) / 448, codes = e4m3(w / scale) (float32 division, nearest even)."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = (np.maximum(amax, np.float32(np.finfo(np.float32).tiny)) / np.float32(E4M3_MAX)).astype(np.float32)
    codes = np.clip(w / scale[:, None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return Fp8Linear(codes, scale)


@dataclass(frozen=True, eq=False)
class W4Linear:
    """A 4-bit weight kept packed (W4A16): AWQ, GPTQ or compressed-tensors int4 read into one canonical form
    (openinfer_kernels/quant/w4_formats.py W4Codes: codes 0..15, 16-bit group scales, zeros or the symmetric 8);
    W[n, k] = (code - zero) · scale, exact in float32."""
    w4: W4Codes

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w4.codes.shape)

    ndim = 2

    @property
    def size(self) -> int:
        return int(self.w4.codes.size)

    @property
    def nbytes(self) -> int:
        """What the device keeps: half a byte a weight and the scales (and zeros)."""
        zeros = 0 if self.w4.zeros is None else self.w4.zeros.size // 2
        return self.size // 2 + int(self.w4.scales.nbytes) + zeros

    def describe(self) -> str:
        kind = "asymmetric (zero points)" if self.w4.zeros is not None else "symmetric"
        return f"int4 {kind}, group {self.w4.group}, {self.w4.scale_dtype} scales"

    def dequantized(self, dtype=np.float32) -> np.ndarray:
        return dequant(self.w4).astype(dtype, copy=False)

    def __array__(self, dtype=None, copy=None):
        return self.dequantized(np.float32 if dtype is None else dtype)


def w4_concat(parts: list[W4Linear]) -> W4Linear | None:
    """The parts stacked along N, or None where their groups or scale types differ."""
    if len(parts) == 1:
        return parts[0]
    ws = [p.w4 for p in parts]
    if len({(w.group, w.scale_dtype, w.fp4, w.codes.shape[1]) for w in ws}) != 1:
        return None
    zeros = None if all(w.zeros is None for w in ws) else np.concatenate(
        [np.full(w.scales.shape, SYMMETRIC_ZERO, np.uint8) if w.zeros is None else w.zeros for w in ws])
    return W4Linear(W4Codes(np.concatenate([w.codes for w in ws]), np.concatenate([w.scales for w in ws]),
                            ws[0].scale_dtype, zeros, ws[0].group, ws[0].fp4))
