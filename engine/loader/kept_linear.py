"""Which linear weights load kept quantized (engine/models/quant_linear.py), chosen per layer at load.

A weight the model line declares keepable (DecoderLM.kept_quantized: its forward passes it only to the linear
ops) is kept when every checkpoint tensor it is packed from is quantized in a kept format:

* quant_method fp8 with [128, 128] blocks: `X.weight` e4m3 and `X.weight_scale_inv` (float32 / bf16 / ue8m0,
  read as float32);
* compressed-tensors float-quantized fp8: `X.weight` e4m3 and `X.weight_scale` (tensor or channel; kept as
  channel scales);
* AWQ (gemm version, zero points), GPTQ (no act-order) and compressed-tensors pack-quantized int4: the codes
  kept packed with their group scales (and zeros), W4A16 (W4Linear);
* `--quantization fp8` (vLLM's flag) on an unquantized checkpoint: every such weight quantized here per
  output row (fp8_per_channel), its activations per token at run time.

The routed experts a line declares (DecoderLM.kept_experts) are kept the same way when every expert's every tensor is
(FP8 blocks or rows, int4, and DeepSeek-V4's FP4: int8 bytes of two e2m1 with ue8m0 `weight_scale_inv` per 32),
stacked into one object per layer and projection (engine/models/quant_experts.py); `--quantization fp8` does not
quantize experts. A layer the checkpoint leaves unquantized (no scale: modules_to_not_convert / ignore), lm_head, the
norms, the routers and experts not kept load as before (engine/loader/quantized.py dequantizes what is quantized
among them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.loader.quantized import (Fp8BlockFormat, Fp8ChannelFormat, Get, Has, Int4Format, PackedIntFormat,
                                     QuantFormat, channel_scale)
from engine.models.quant_experts import Fp8Experts, W4Experts, stack_experts
from engine.models.quant_linear import Fp8Linear, W4Linear, fp8_concat, fp8_per_channel, w4_concat
from openinfer_kernels.quant.w4_formats import from_fp4
from engine.models.weights import WeightSpec
from openinfer_kernels.quant.fp8_ref import E4M3, GROUP

QUANTIZATIONS = ("fp8",)          # --quantization values served


def check_quantization(quantization: str | None) -> None:
    """ValueError for a --quantization value not served, naming why."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported: --quantization fp8 quantizes a bf16 "
                         f"checkpoint at load (per-channel e4m3 weights, dynamic per-token activations); "
                         f"checkpoints quantized in fp8, compressed-tensors or pack-quantized int formats are read "
                         f"from their quantization_config without the flag")


@dataclass(frozen=True)
class LinearKeeper:
    """keep(spec) -> the spec's weight kept quantized, or None (loaded as before)."""
    fmt: QuantFormat | None
    quantize: bool                  # --quantization fp8: quantize unquantized keepable weights (not experts)
    suffixes: tuple[str, ...]
    has: Has
    get: Get
    expert_suffixes: tuple[str, ...] = ()

    def keep(self, spec: WeightSpec) -> Fp8Linear | W4Linear | Fp8Experts | W4Experts | None:
        if spec.experts:
            return self._experts(spec) if spec.name.endswith(self.expert_suffixes) else None
        if not spec.name.endswith(self.suffixes):
            return None
        parts = []
        for name, shape in spec.parts:
            part = self._kept_part(name, shape)
            if part is None:
                return None
            parts.append(part)
        return w4_concat(parts) if isinstance(parts[0], W4Linear) else fp8_concat(parts)

    def _experts(self, spec: WeightSpec) -> Fp8Experts | W4Experts | None:
        """Stacked experts kept when every expert's every part is (FP8 blocks / rows, int4 or FP4)."""
        per = len(spec.parts) // spec.experts
        if self._kept_part(*spec.parts[0], quantize=False) is None:          # not kept: nothing more read
            return None
        groups = [[self._kept_part(name, shape, quantize=False) for name, shape in spec.parts[e * per:(e + 1) * per]]
                  for e in range(spec.experts)]
        return None if any(p is None for g in groups for p in g) else stack_experts(groups)

    def _kept_part(self, name: str, shape: tuple[int, ...], quantize: bool = True) -> Fp8Linear | W4Linear | None:
        if isinstance(self.fmt, (Int4Format, PackedIntFormat)):
            return self._w4(name, shape)
        if isinstance(self.fmt, Fp8BlockFormat) and self.has(name) and self.get(name).dtype in (np.int8, np.uint8):
            return self._fp4(name, shape)
        return self._part(name, shape, quantize)

    def _fp4(self, name: str, shape: tuple[int, ...]) -> W4Linear | None:
        """An FP4 part of an fp8 checkpoint (DeepSeek-V4's experts: bytes [N, K/2], ue8m0 scales [N, K/32])."""
        scale = name[:-len("weight")] + "weight_scale_inv"
        if not self.has(scale) or len(shape) != 2:
            return None
        w4 = from_fp4(self.get(name), self.get(scale))
        if tuple(w4.codes.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} holds fp4 values {tuple(w4.codes.shape)}, expected {shape}")
        return W4Linear(w4)

    def _w4(self, name: str, shape: tuple[int, ...]) -> W4Linear | None:
        """An AWQ / GPTQ / pack-quantized int4 part, kept packed (None: the tensor is not in that format)."""
        base = name[:-len("weight")]
        w4 = self.fmt.codes(base, self.has, self.get) if self.has(base + self.fmt.marker) else None
        if w4 is not None and tuple(w4.codes.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(w4.codes.shape)}, expected {shape}")
        return None if w4 is None else W4Linear(w4)

    def _part(self, name: str, shape: tuple[int, ...], quantize: bool = True) -> Fp8Linear | None:
        base = name[:-len("weight")]
        if not name.endswith(".weight") or not self.has(name) or len(shape) != 2 or shape[1] % GROUP:
            return None
        block, channel = self.has(base + "weight_scale_inv"), self.has(base + "weight_scale")
        if isinstance(self.fmt, Fp8BlockFormat) and self.fmt.block == (GROUP, GROUP) and block:
            return Fp8Linear(_e4m3(self.get(name), name, shape), np.asarray(self.get(base + "weight_scale_inv"))
                             .astype(np.float32))
        if isinstance(self.fmt, Fp8ChannelFormat) and channel:
            scale = channel_scale(self.get(base + "weight_scale"), shape[0])
            return Fp8Linear(_e4m3(self.get(name), name, shape), scale)
        if self.quantize and quantize and self.fmt is None:
            w = self.get(name)
            if tuple(w.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
            return fp8_per_channel(w)
        return None


def _e4m3(w: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(w.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
    if w.dtype == E4M3:
        return w
    if w.dtype in (np.uint8, np.int8):
        return w.view(E4M3)
    raise ValueError(f"tensor {name!r}: an fp8 checkpoint's weight must be float8 e4m3, got {w.dtype}")


def linear_keeper(fmt: QuantFormat | None, quantization: str | None, model: Any, has: Has,
                  get: Get) -> LinearKeeper | None:
    """The keeper of a checkpoint (format fmt) for a model line, or None where nothing can be kept;
    ValueError for --quantization where it cannot serve (an unsupported value, a checkpoint quantized in
    another format, a line that keeps no linear layers)."""
    check_quantization(quantization)
    if quantization is not None:
        if fmt is not None and not isinstance(fmt, (Fp8BlockFormat, Fp8ChannelFormat)):
            raise ValueError(f"--quantization {quantization}: the checkpoint is already quantized ({fmt.describe()})")
        if not model.kept_quantized:
            raise ValueError(f"--quantization {quantization}: the {model.config.model_type} line keeps no quantized "
                             f"linear layers (its weights would only be dequantized again)")
    if not (model.kept_quantized or model.kept_experts) or (fmt is None and quantization is None):
        return None
    return LinearKeeper(fmt, quantization == "fp8", model.kept_quantized, has, get, model.kept_experts)
