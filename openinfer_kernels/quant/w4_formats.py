"""4-bit weight formats read into one canonical form, with their exact dequantization (numpy, no torch).

``W4Codes``: ``codes`` uint8 [..., N, K] (0..15), ``scales`` [..., N, G] as 16-bit bits (bf16 or fp16, G = K / group),
``zeros`` uint8 [..., N, G] or None (the symmetric offset 8), the weight ``W[n, k] = (codes - zero) · scale`` of
its group (int codes) or ``e2m1(codes) · scale`` (fp4). ``dequant`` computes it exactly in float32 (a 4-bit
value times a 16-bit scale needs at most 16 bits); the GPU kernels (raw_cuda/gemv_w4.cu) use its bf16
rounding, which is what the load-time dequantization (engine/loader/quantized.py) holds on the GPU.

The readers, each to its format's own rule:

* AWQ, gemm version (``quant_method awq``, ``version gemm``, ``zero_point`` true): ``qweight`` int32 [K, N/8]
  packed along N, column ``8c + j`` of word ``c`` in nibble ``AWQ_REVERSE_ORDER[j]`` (AutoAWQ packs in the
  order [0, 2, 4, 6, 1, 3, 5, 7]); ``qzeros`` int32 [K/g, N/8] likewise; ``scales`` fp16 [K/g, N];
  ``W[n, k] = (q[k, n] - z[k // g, n]) · s[k // g, n]`` (AutoAWQ's dequantize_gemm, in fp16 there).
* GPTQ (``quant_method gptq``, ``desc_act`` false): ``qweight`` int32 [K/8, N] packed along K (element k in
  nibble k % 8), ``qzeros`` int32 [K/g, N/8] packed along N, ``scales`` fp16 [K/g, N], ``g_idx`` absent or
  k // g. The zero point of the ``gptq`` checkpoint format (v1) is the stored nibble + 1, of ``gptq_v2``
  the nibble itself (GPTQModel converts v1 to v2 by that + 1 per nibble; vLLM's gptq kernels add it too);
  a symmetric 4-bit checkpoint stores 7 (v1), i.e. zero 8 — as Marlin assumes for ``sym``.
* compressed-tensors ``pack-quantized`` int4, symmetric (Kimi-K2-Thinking's experts): ``weight_packed``
  int32 [N, K/8] (element k in nibble k % 8, stored as q + 8), ``weight_scale`` [N, K/g] bf16 (or fp16).
* FP4 e2m1 with ue8m0 scales per 32 (DeepSeek-V4's experts): bytes [N, K/2], element 2k in the low nibble
  of byte k; the scale 2^(e - 127) is exact in bf16 (e = 0: a subnormal; 255: NaN).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # column j of an AWQ word sits in nibble AWQ_REVERSE_ORDER[j]
BF16, FP16 = "bf16", "fp16"
SYMMETRIC_ZERO = 8
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # by code


@dataclass(frozen=True)
class W4Codes:
    """4-bit codes with their group scales (and zeros): the canonical form every reader returns."""

    codes: np.ndarray              # uint8 [..., N, K], 0..15
    scales: np.ndarray             # uint16 [..., N, K / group]: the bits of scale_dtype values
    scale_dtype: str               # BF16 or FP16
    zeros: np.ndarray | None       # uint8 [..., N, K / group]; None: SYMMETRIC_ZERO
    group: int
    fp4: bool = False              # codes are e2m1 (no zeros)

    def __post_init__(self):
        n, k = self.codes.shape[-2:]
        if self.group < 32 or self.group % 32 or k % self.group:
            raise ValueError(f"group {self.group} must be a multiple of 32 dividing K = {k}")
        want = (*self.codes.shape[:-1], k // self.group)
        if self.scales.shape != want or (self.zeros is not None and self.zeros.shape != want):
            raise ValueError(f"codes {self.codes.shape} in groups of {self.group} need scales / zeros {want}, got "
                             f"{self.scales.shape} / {None if self.zeros is None else self.zeros.shape}")
        if self.scale_dtype not in (BF16, FP16):
            raise ValueError(f"scale dtype {self.scale_dtype!r}: bf16 or fp16")
        if self.fp4 and self.zeros is not None:
            raise ValueError("e2m1 codes take no zero points")


def expert_codes(w: W4Codes, e: int | slice) -> W4Codes:
    """Expert e of stacked codes [E, N, K] (a slice: those experts; or rows of codes [N, K]), with their
    scales (and zeros)."""
    return W4Codes(w.codes[e], w.scales[e], w.scale_dtype, None if w.zeros is None else w.zeros[e], w.group, w.fp4)


def scale_values(scale_bits: np.ndarray, scale_dtype: str) -> np.ndarray:
    """float32 values of 16-bit scale bits (exact)."""
    import ml_dtypes

    bits = np.asarray(scale_bits, np.uint16)
    return (bits.view(ml_dtypes.bfloat16) if scale_dtype == BF16 else bits.view(np.float16)).astype(np.float32)


def dequant(w: W4Codes) -> np.ndarray:
    """The weights [..., N, K] in float32, exact: (codes - zero) · scale or e2m1(codes) · scale."""
    s = np.repeat(scale_values(w.scales, w.scale_dtype), w.group, axis=-1)
    if w.fp4:
        return E2M1_VALUES[w.codes] * s
    z = SYMMETRIC_ZERO if w.zeros is None else np.repeat(w.zeros.astype(np.float32), w.group, axis=-1)
    return (w.codes.astype(np.float32) - z) * s


def nibbles(words: np.ndarray) -> np.ndarray:
    """The 8 nibbles of int32 words [..., W] as uint8 [..., W, 8], nibble p = bits 4p .. 4p + 3."""
    u = np.asarray(words).view(np.uint32)
    return ((u[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF).astype(np.uint8)


def _fp16_bits(scales: np.ndarray, what: str) -> np.ndarray:
    if np.asarray(scales).dtype != np.float16:
        raise TypeError(f"{what}: scales must be float16, got {np.asarray(scales).dtype}")
    return np.asarray(scales).view(np.uint16)


def _drop_symmetric(zeros: np.ndarray) -> np.ndarray | None:
    """None (the kernels' constant zero) where every zero is SYMMETRIC_ZERO."""
    return None if np.all(zeros == SYMMETRIC_ZERO) else zeros


def from_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int) -> W4Codes:
    """AWQ gemm-version tensors (qweight [K, N/8], qzeros [K/g, N/8], scales fp16 [K/g, N]) -> W4Codes [N, K]."""
    K, words = qweight.shape
    order = list(AWQ_REVERSE_ORDER)
    q = nibbles(qweight)[..., order].reshape(K, words * 8)        # [K, N]: logical column order
    z = nibbles(qzeros)[..., order].reshape(qzeros.shape[0], words * 8)
    if z.shape[0] * group != K or scales.shape != z.shape:
        raise ValueError(f"AWQ qweight {qweight.shape}, qzeros {qzeros.shape}, scales {scales.shape} "
                         f"disagree with group {group}")
    return W4Codes(np.ascontiguousarray(q.T), np.ascontiguousarray(_fp16_bits(scales, "AWQ").T), FP16,
                   _drop_symmetric(np.ascontiguousarray(z.T)), group)


def from_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int,
              g_idx: np.ndarray | None = None, v2: bool = False) -> W4Codes:
    """GPTQ tensors (qweight [K/8, N], qzeros [K/g, N/8], scales fp16 [K/g, N]) -> W4Codes [N, K]; ``v2``:
    the ``gptq_v2`` checkpoint format (zeros stored as they are, not minus one)."""
    words, N = qweight.shape
    K = words * 8
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(K) // group):
        raise ValueError("GPTQ with act-order (desc_act: a permuted g_idx) is not supported")
    q = nibbles(qweight).transpose(0, 2, 1).reshape(K, N)           # element k of a column: word k // 8, nibble k % 8
    z = nibbles(qzeros).reshape(qzeros.shape[0], -1)[:, :N].astype(np.uint8) + np.uint8(0 if v2 else 1)
    if z.shape[0] * group != K or scales.shape != z.shape:
        raise ValueError(f"GPTQ qweight {qweight.shape}, qzeros {qzeros.shape}, scales {scales.shape} "
                         f"disagree with group {group}")
    return W4Codes(np.ascontiguousarray(q.T), np.ascontiguousarray(_fp16_bits(scales, "GPTQ").T), FP16,
                   _drop_symmetric(np.ascontiguousarray(z.T)), group)


def from_compressed_tensors(weight_packed: np.ndarray, weight_scale: np.ndarray, shape: tuple[int, int],
                            group: int) -> W4Codes:
    """compressed-tensors pack-quantized symmetric int4 (weight_packed [..., N, K/8], weight_scale bf16 or fp16
    [..., N, K/g], weight_shape (N, K)) -> W4Codes: the stored unsigned q + 8 are the codes, zero 8."""
    import ml_dtypes

    N, K = (int(d) for d in shape)
    codes = nibbles(weight_packed).reshape(*weight_packed.shape[:-1], -1)[..., :K]
    dtype = np.asarray(weight_scale).dtype
    if dtype not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        raise TypeError(f"compressed-tensors int4: scales must be bf16 or fp16 for the kernels, got {dtype}")
    if codes.shape[-2] != N:
        raise ValueError(f"weight_packed has {codes.shape[-2]} rows, weight_shape says {N}")
    return W4Codes(np.ascontiguousarray(codes), np.asarray(weight_scale).view(np.uint16),
                   BF16 if dtype == np.dtype(ml_dtypes.bfloat16) else FP16, None, group)


def ue8m0_to_bf16_bits(scale: np.ndarray) -> np.ndarray:
    """ue8m0 exponents (uint8 or float8_e8m0fnu) -> the bf16 bits of 2^(e - 127), exactly (0 -> the subnormal
    2^-127, 255 -> NaN)."""
    e = np.asarray(scale).view(np.uint8).astype(np.uint16)
    return np.where(e == 0, np.uint16(0x0040), np.where(e == 255, np.uint16(0x7FC0), e << 7)).astype(np.uint16)


def from_fp4(packed: np.ndarray, scale: np.ndarray) -> W4Codes:
    """FP4 bytes [..., N, K/2] (two e2m1, the low nibble first) with ue8m0 scales [..., N, K/group] -> W4Codes."""
    u = np.asarray(packed).view(np.uint8)
    codes = np.stack([u & 0xF, u >> 4], axis=-1).reshape(*u.shape[:-1], -1)
    group = codes.shape[-1] // max(1, scale.shape[-1])
    return W4Codes(codes, ue8m0_to_bf16_bits(scale), BF16, None, group, fp4=True)
