"""Quantized checkpoints, dequantized at load: the checkpoint seen through `dequantizing(...)` answers
each `X.weight` with its dequantized values, so every model line loads them unchanged.

* FP8 with block scales (DeepSeek-V3, Kimi-K2-Instruct: quantization_config {"quant_method": "fp8",
  "weight_block_size": [bn, bk]}): `X.weight` float8 e4m3 [N, K] and `X.weight_scale_inv` [ceil(N/bn),
  ceil(K/bk)] (float32, bf16 or ue8m0); w[n, k] = fp8[n, k] · scale_inv[n // bn, k // bk], computed in
  float32 (transformers' Fp8Dequantize and DeepSeek's weight_dequant; a last partial block takes its
  block's scale).
  FP4 weights in such a checkpoint (DeepSeek-V4's experts: int8 bytes holding two e2m1 values, the low nibble
  first, with one ue8m0 scale per [1, 32] block) take their block from the scale grid, as transformers does.
* compressed-tensors `pack-quantized` (Kimi-K2-Thinking's int4 routed experts: {"quant_method":
  "compressed-tensors", "format": "pack-quantized", config_groups with weights {"type": "int",
  "num_bits": 4, "symmetric": true, "strategy": "group", "group_size": 32}}): `X.weight_packed` int32
  [N, ceil(K·bits/32)] holds element k of a row at bits (k·bits) mod 32 of word k·bits // 32 as the
  unsigned value q + 2^(bits-1); `X.weight_scale` [N, K / group]; `X.weight_shape` [N, K];
  w[n, k] = q[n, k] · scale[n, k // group], multiplied in the scale's dtype (compressed-tensors'
  dequantize: bf16 scales give bf16-rounded products) and returned as `dtype`.
* compressed-tensors `float-quantized` FP8 (config_groups weights {"type": "float", "num_bits": 8, "strategy":
  "tensor" | "channel"}): `X.weight` float8 e4m3 [N, K] and `X.weight_scale` ([1] or [N, 1]);
  w[n, k] = fp8[n, k] · scale[n] in float32. Activation scales (`input_scale`, static) are not read: the
  activations are quantized dynamically per token (vLLM's dynamic scheme).

Values come back as float32 by default (exact against those references). A model line's linear layers and routed
experts in a kept format are kept as the checkpoint ships them instead (engine/loader/kept_linear.py); what is
dequantized here is the rest (MLA projections, experts the kept kernels cannot take, lines that keep none).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from openinfer_kernels.quant.w4_formats import W4Codes, from_awq, from_compressed_tensors, from_gptq
from openinfer_kernels.quant.w4_formats import dequant as w4_dequant

log = logging.getLogger(__name__)

Has = Callable[[str], bool]
Get = Callable[[str], np.ndarray]


def dequant_fp8_block(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                      dtype=np.float32) -> np.ndarray:
    """fp8 weight [..., N, K] times its block scale (scale_inv [..., ceil(N/bn), ceil(K/bk)])."""
    (N, K), (bn, bk) = weight.shape[-2:], block
    want = (-(-N // bn), -(-K // bk))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(f"weight {weight.shape} with block {block} needs scales {want}, got {scale_inv.shape}")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bn, axis=-2)[..., :N, :], bk, axis=-1)[..., :K]
    return (np.asarray(weight).astype(np.float32) * s).astype(dtype)


FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """e2m1 values [..., 2·K] from bytes [..., K], element 2k in the low nibble of byte k."""
    u = np.asarray(packed).view(np.uint8)
    return np.stack([FP4_E2M1[u & 0xF], FP4_E2M1[u >> 4]], axis=-1).reshape(*u.shape[:-1], -1)


def dequant_fp4_block(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """FP4 bytes [N, K/2] times their scales [N / bn, K / bk], the block taken from the scale grid."""
    w = unpack_fp4(packed)
    (N, K), (gn, gk) = w.shape[-2:], scale.shape[-2:]
    if N % gn or K % gk:
        raise ValueError(f"fp4 weight [{N}, {K}] is not tiled by a scale grid of {scale.shape}")
    return dequant_fp8_block(w, scale, (N // gn, K // gk), dtype)


def unpack_int32(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The signed bits-wide values [..., cols] packed in int32 words (compressed-tensors' pack_to_int32
    for bits dividing 32: element k at bits (k·bits) % 32 of word k·bits // 32, stored as q + 2^(bits-1))."""
    if 32 % bits:
        raise ValueError(f"packed int{bits}: only widths that divide 32 are supported")
    per = 32 // bits
    words = np.asarray(packed).view(np.uint32)
    if words.shape[-1] * per < cols:
        raise ValueError(f"{words.shape[-1]} int32 words hold {words.shape[-1] * per} int{bits} values, not {cols}")
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))
    values = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    values = values.reshape(*words.shape[:-1], -1)[..., :cols]
    return (values.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


def dequant_packed_group(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], bits: int,
                         group: int, dtype=np.float32) -> np.ndarray:
    """Symmetric packed ints [N, K] = shape times their group scale (scale [N, K / group])."""
    N, K = (int(d) for d in shape)
    if K % group or tuple(scale.shape) != (N, K // group):
        raise ValueError(f"weight [{N}, {K}] in groups of {group} needs scales {(N, K // group)}, got {scale.shape}")
    q = unpack_int32(packed, bits, K)
    if q.shape[0] != N:
        raise ValueError(f"packed weight has {q.shape[0]} rows, weight_shape says {N}")
    product = q.astype(np.float32) * np.repeat(np.asarray(scale, np.float32), group, axis=-1)
    return product.astype(scale.dtype).astype(dtype, copy=False)      # in the scale's dtype, as compressed-tensors


def scaled_view(has: Has, get: Get, scale_name: str, dequant: Callable[[np.ndarray, np.ndarray], np.ndarray]
                ) -> tuple[Has, Get]:
    """(has, get) where each `X.weight` with an `X.<scale_name>` comes back as dequant(weight, scale)."""
    def get_weight(name: str) -> np.ndarray:
        scale = name[:-len("weight")] + scale_name if name.endswith(".weight") else None
        if scale is None or not has(scale):
            return get(name)
        return dequant(get(name), get(scale))
    return has, get_weight


@dataclass(frozen=True)
class Fp8BlockFormat:
    block: tuple[int, int]

    def describe(self) -> str:
        return f"FP8 e4m3 weights with {self.block[0]}x{self.block[1]} block scales"

    def view(self, has: Has, get: Get, dtype) -> tuple[Has, Get]:
        def dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
            if w.dtype in (np.int8, np.uint8):                      # FP4: two e2m1 values per byte
                return dequant_fp4_block(w, s, dtype)
            return dequant_fp8_block(w, s, self.block, dtype)
        return scaled_view(has, get, "weight_scale_inv", dequant)


@dataclass(frozen=True)
class PackedIntFormat:
    bits: int
    group: int | None          # None: the group follows from the scale's shape (channel: one group per row)
    marker = "weight_packed"   # the tensor a packed weight `X.weight` is stored as

    def describe(self) -> str:
        return f"compressed-tensors pack-quantized int{self.bits} weights (group {self.group or 'per channel'})"

    def _parts(self, base: str, get: Get) -> tuple[np.ndarray, np.ndarray, tuple[int, int], int]:
        """(weight_packed, weight_scale, the weight's shape, its group) of `base`."""
        shape = tuple(int(d) for d in np.asarray(get(base + "weight_shape")).reshape(-1))
        scale = get(base + "weight_scale")
        return get(base + "weight_packed"), scale, shape, self.group or shape[1] // scale.shape[-1]

    def codes(self, base: str, has: Has, get: Get) -> W4Codes | None:
        """A symmetric int4 weight kept packed (None: other bits, or zero points: dequantized instead)."""
        if self.bits != 4 or has(base + "weight_zero_point"):
            return None
        return from_compressed_tensors(*self._parts(base, get))

    def view(self, has: Has, get: Get, dtype) -> tuple[Has, Get]:
        def dequant(base: str) -> np.ndarray:
            if has(base + "weight_zero_point"):
                raise ValueError(f"{base}weight: asymmetric packed weights (weight_zero_point) are not supported")
            packed, scale, shape, group = self._parts(base, get)
            return dequant_packed_group(packed, scale, shape, self.bits, group, dtype)
        return packed_view(has, get, self.marker, dequant)


def packed_view(has: Has, get: Get, marker: str, dequant: Callable[[str], np.ndarray]) -> tuple[Has, Get]:
    """(has, get) answering `X.weight` for a weight stored packed as `X.<marker>` (and its companions) with
    dequant("X.")."""
    def base_of(name: str) -> str | None:
        base = name[:-len("weight")] if name.endswith(".weight") else None
        return base if base is not None and has(base + marker) else None

    def get_weight(name: str) -> np.ndarray:
        base = base_of(name)
        return get(name) if base is None else dequant(base)
    return (lambda name: has(name) or base_of(name) is not None), get_weight


def channel_scale(scale: np.ndarray, rows: int) -> np.ndarray:
    """float32 [rows] from a tensor scale ([1] / []) or a channel scale ([rows, 1] / [rows])."""
    s = np.asarray(scale).astype(np.float32).reshape(-1)
    if s.size == 1:
        return np.repeat(s, rows)
    if s.size != rows:
        raise ValueError(f"a weight of {rows} rows needs a tensor or channel scale, got {list(np.shape(scale))}")
    return s


@dataclass(frozen=True)
class Fp8ChannelFormat:
    strategy: str              # "tensor" | "channel"

    def describe(self) -> str:
        return f"compressed-tensors float-quantized fp8 weights (per {self.strategy} scales)"

    def view(self, has: Has, get: Get, dtype) -> tuple[Has, Get]:
        def dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
            w = np.asarray(w).astype(np.float32)
            return (w * channel_scale(s, w.shape[0])[:, None]).astype(dtype)
        return scaled_view(has, get, "weight_scale", dequant)


def compressed_tensors_format(q: dict[str, Any]) -> Fp8ChannelFormat | PackedIntFormat:
    """The one weight scheme of a compressed-tensors config (pack-quantized int or float-quantized fp8)."""
    groups = list((q.get("config_groups") or {}).values())
    formats = {g.get("format") or q.get("format") for g in groups}
    weights = [g.get("weights") or {} for g in groups]
    kinds = {(w.get("type"), int(w.get("num_bits") or 0), bool(w.get("symmetric", True)),
              w.get("strategy"), w.get("group_size")) for w in weights}
    if len(formats) != 1 or len(kinds) != 1 or formats & {"pack-quantized", "float-quantized"} != formats:
        raise ValueError(f"compressed-tensors: only one pack-quantized (int) or float-quantized (fp8) weight scheme "
                         f"is supported, got formats {sorted(map(str, formats))} and schemes {sorted(map(str, kinds))}")
    kind, bits, symmetric, strategy, group = kinds.pop()
    if formats == {"float-quantized"}:
        if kind != "float" or bits != 8 or strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors float-quantized: only fp8 (type float, 8 bits) with tensor or "
                             f"channel scales is supported (int weights come pack-quantized), got type={kind} "
                             f"bits={bits} strategy={strategy}")
        return Fp8ChannelFormat(strategy)
    if kind != "int" or not symmetric or strategy not in ("group", "channel") or 32 % bits:
        raise ValueError(f"compressed-tensors: unsupported weight scheme type={kind} bits={bits} "
                         f"symmetric={symmetric} strategy={strategy}")
    return PackedIntFormat(bits, int(group) if strategy == "group" else None)


@dataclass(frozen=True)
class Int4Format:
    """AWQ (gemm version, zero points) or GPTQ (no act-order; v1 zeros stored minus one, or gptq_v2) int4 linear
    weights: `X.qweight`, `X.qzeros`, `X.scales` fp16 (GPTQ: and `X.g_idx`), read by
    openinfer_kernels/quant/w4_formats.py (each to its format's rule) and dequantized exactly in float32."""
    method: str                # "awq" | "gptq"
    group: int                 # -1: one group per row (GPTQ)
    v2: bool = False
    marker = "qweight"         # the tensor a packed weight `X.weight` is stored as

    def describe(self) -> str:
        return f"{self.method} int4 weights (group {self.group})"

    def codes(self, base: str, has: Has, get: Get) -> W4Codes:
        qweight = get(base + "qweight")
        K = qweight.shape[0] * (1 if self.method == "awq" else 8)
        group = self.group if self.group > 0 else K
        if self.method == "awq":
            return from_awq(qweight, get(base + "qzeros"), get(base + "scales"), group)
        g_idx = get(base + "g_idx") if has(base + "g_idx") else None
        return from_gptq(qweight, get(base + "qzeros"), get(base + "scales"), group, g_idx, self.v2)

    def view(self, has: Has, get: Get, dtype) -> tuple[Has, Get]:
        return packed_view(has, get, self.marker, lambda base: w4_dequant(self.codes(base, has, get)).astype(dtype))


def int4_format(method: str, q: dict[str, Any]) -> Int4Format:
    """AWQ / GPTQ quantization_config -> Int4Format; ValueError for what the readers do not take."""
    bits = int(q.get("bits") or q.get("w_bit") or 0)
    group = int(q.get("group_size") or q.get("q_group_size") or 0)
    if bits != 4 or group == 0:
        raise ValueError(f"{method}: only 4-bit weights with a group_size are supported, got bits {bits}")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or not q.get("zero_point", True):
            raise ValueError(f"awq: only the gemm version with zero points is supported, got version {version!r}, "
                             f"zero_point {q.get('zero_point')}")
        return Int4Format("awq", group)
    if q.get("desc_act"):
        raise ValueError("gptq with desc_act (act-order) is not supported")
    fmt = str(q.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r}: gptq or gptq_v2")
    return Int4Format("gptq", group, fmt == "gptq_v2")


QuantFormat = Fp8BlockFormat | Fp8ChannelFormat | PackedIntFormat | Int4Format


def quant_format(raw: dict[str, Any]) -> QuantFormat | None:
    """The weight format a config.json's quantization_config names (None: not quantized); ValueError for
    one this loader cannot dequantize."""
    q = raw.get("quantization_config") or raw.get("compression_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not block or len(block) != 2 or q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoints: only e4m3 with weight_block_size [bn, bk] are supported, got {q}")
        return Fp8BlockFormat((int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return compressed_tensors_format(q)
    if method in ("awq", "gptq"):
        return int4_format(method, q)
    raise ValueError(f"unsupported quantization_config quant_method {method!r} (supported: fp8, compressed-tensors, "
                     f"awq, gptq)")


def dequantizing(raw: dict[str, Any], has: Has, get: Get, dtype=np.float32) -> tuple[Has, Get]:
    """(has, get) over a checkpoint whose quantized weights come back dequantized to `dtype` (said once
    in the log); the checkpoint unchanged when the config names no quantization."""
    fmt = quant_format(raw)
    if fmt is None:
        return has, get
    log.info("%s: what the model line does not keep quantized is dequantized at load to %s (on the GPU held as bf16)",
             fmt.describe(), np.dtype(dtype).name)
    return fmt.view(has, get, dtype)
