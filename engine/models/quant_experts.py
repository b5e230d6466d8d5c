"""A layer's routed experts kept quantized: what a model line passes to ops.moe.experts in place of the stacked
bf16 arrays [E, N, K] when the checkpoint ships its experts quantized. The lines never look inside: each
executor's MoE op serves them on its own kernels (numpy: an emulation of the GPU's numerics).

* Fp8Experts (FP8 W8A8: DeepSeek-V3, Kimi-K2-Instruct, Qwen3-30B-A3B-FP8): e4m3 codes [E, N, K] with float32
  scales per [128, 128] block ([E, ceil(N/128), K/128], `weight_scale_inv`) or per row ([E, N]); the activations
  are quantized per token and 128-wide group on the fly, as for the dense Fp8Linear.
* W4Experts (W4A16: compressed-tensors pack-quantized int4, Kimi-K2-Thinking; DeepSeek-V4's FP4 e2m1 with
  ue8m0 scales per 32): the canonical 4-bit codes (openinfer_kernels/quant/w4_formats.py W4Codes) stacked
  [E, N, K]; the products are exact to the weights as the kernels dequantize them (bf16).

`expert(e)` is one expert as the dense kept type (Fp8Linear / W4Linear), so every executor reuses its linear
numerics; `np.asarray` dequantizes (float32), as a dequantizing load would have given.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.models.quant_linear import Fp8Linear, W4Linear, fp8_concat, w4_concat
from openinfer_kernels.quant.w4_formats import W4Codes

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Fp8Experts:
    """codes: e4m3 [E, N, K] (or float32 holding them: the numpy executor's copy); scale float32
    [E, ceil(N/128), K/128] (blocks) or [E, N] (rows)."""
    codes: np.ndarray
    scale: np.ndarray

    def __post_init__(self):
        if self.codes.ndim != 3 or self.scale.shape[0] != self.codes.shape[0]:
            raise ValueError(f"FP8 experts need codes [E, N, K] and scales per expert, got {self.codes.shape} "
                             f"and {self.scale.shape}")
        self.expert(0)                                   # the per-expert shapes, checked by Fp8Linear

    shape = property(lambda self: tuple(self.codes.shape))
    ndim = 3
    size = property(lambda self: int(self.codes.size))
    channel = property(lambda self: self.scale.ndim == 2)

    @property
    def nbytes(self) -> int:
        """What the device keeps: one byte a weight and the scales."""
        return int(self.codes.size) + int(self.scale.nbytes)

    def expert(self, e: int) -> Fp8Linear:
        return Fp8Linear(self.codes[e], self.scale[e])

    def describe(self) -> str:
        return "experts " + self.expert(0).describe()

    def dequantized(self, dtype=np.float32) -> np.ndarray:
        return np.stack([self.expert(e).dequantized(dtype) for e in range(self.shape[0])])

    def __array__(self, dtype=None, copy=None):
        return self.dequantized(np.float32 if dtype is None else dtype)


@dataclass(frozen=True, eq=False)
class W4Experts:
    """The experts' 4-bit codes (W4Codes with codes [E, N, K], scales [E, N, K / group])."""
    w4: W4Codes

    def __post_init__(self):
        if self.w4.codes.ndim != 3:
            raise ValueError(f"4-bit experts need codes [E, N, K], got {self.w4.codes.shape}")

    shape = property(lambda self: tuple(self.w4.codes.shape))
    ndim = 3
    size = property(lambda self: int(self.w4.codes.size))

    @property
    def nbytes(self) -> int:
        """What the device keeps: half a byte a weight and the scales (and zeros)."""
        return W4Linear(self.w4).nbytes

    def describe(self) -> str:
        w = self.w4
        kind = "fp4 e2m1, ue8m0 scales" if w.fp4 else W4Linear(w).describe()
        return f"experts {kind}" + (f", group {w.group}" if w.fp4 else "")

    def dequantized(self, dtype=np.float32) -> np.ndarray:
        """Each weight as the kernels dequantize it: its exact product rounded once to bf16 (w4.cuh; for bf16
        scales compressed-tensors' own dequantization, for FP4 the exact value)."""
        return W4Linear(self.w4).dequantized(ml_dtypes.bfloat16).astype(dtype)

    def __array__(self, dtype=None, copy=None):
        return self.dequantized(np.float32 if dtype is None else dtype)


KEPT = (Fp8Linear, W4Linear, Fp8Experts, W4Experts)      # every weight type kept quantized


def kept_families(weights: dict) -> dict[str, tuple[str, int, type]]:
    """Layer family (the weight name without its layer: "qkv_proj") -> (the kept format, layers, its type)."""
    out: dict[str, tuple[str, int, type]] = {}
    for name, w in weights.items():
        if isinstance(w, KEPT):
            family = name.rsplit(".", 1)[-1]
            fmt, count, kind = out.get(family, (w.describe(), 0, type(w)))
            out[family] = (fmt if fmt == w.describe() else "mixed formats", count + 1, kind)
    return out


def log_kept(weights: dict, kernels: dict[type, str]) -> None:
    """The startup log: per layer family, the format kept and the kernel serving it (kernels: kept type -> the
    kernels serving it in this executor)."""
    for family, (fmt, count, kind) in sorted(kept_families(weights).items()):
        what = family if kind in (Fp8Experts, W4Experts) else "linear " + family
        log.info("quantized %s (%d layers): %s, served by %s", what, count, fmt, kernels[kind])


def stack_experts(experts: list[list[Fp8Linear | W4Linear]]) -> Fp8Experts | W4Experts | None:
    """Each expert's parts (gate and up, or down) concatenated along N, the experts stacked; None where the
    parts cannot concatenate (a block-scaled part before the last not whole 128-row blocks) or the experts differ
    in format, group or shape."""
    joined = [fp8_concat(parts) if isinstance(parts[0], Fp8Linear) else w4_concat(parts) for parts in experts]
    if any(j is None for j in joined) or len({type(j) for j in joined}) != 1:
        return None
    if isinstance(joined[0], Fp8Linear):
        if len({(j.shape, j.scale.shape) for j in joined}) != 1:
            return None
        return Fp8Experts(np.stack([np.asarray(j.codes) for j in joined]), np.stack([j.scale for j in joined]))
    ws = [j.w4 for j in joined]
    if len({(w.codes.shape, w.group, w.scale_dtype, w.fp4, w.zeros is None) for w in ws}) != 1:
        return None
    zeros = None if ws[0].zeros is None else np.stack([w.zeros for w in ws])
    return W4Experts(W4Codes(np.stack([w.codes for w in ws]), np.stack([w.scales for w in ws]), ws[0].scale_dtype,
                             zeros, ws[0].group, ws[0].fp4))
