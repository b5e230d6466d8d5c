"""Random quantized weights for the quantized-weight kernels' tests and benchmark (numpy; shapes of real models).

* ``random_w4(rng, kind, N, K, group)``: W4Codes of one format: "fp4" (e2m1, ue8m0 scales per 32, every code),
  "bf16" (compressed-tensors int4: symmetric, bf16 scales), "fp16" (GPTQ symmetric: fp16 scales),
  "fp16_zero" (AWQ / asymmetric GPTQ: fp16 scales and a zero per group, 16 included: GPTQ v1's +1 of 15).
* ``grouped_layout(counts, tile_m)``: moe_align's expert-grouped layout of that many rows an expert (tile_expert,
  row_token), for the grouped kernels.
* ``random_fp8_weight(rng, N, K, channel)``: e4m3 [N, K] with float32 scales per [128, 128] block (amax / 448
  per block, as DeepSeek-V3's checkpoints; harness.quantized) or one per row.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from harness.quantized import quantize_fp8_block
from openinfer_kernels.quant import w4_formats as fmt

W4_KINDS = ("fp4", "bf16", "fp16", "fp16_zero")
# Qwen3-8B's projections (N, K): qkv (32 + 2·8 heads of 128), o, gate_up (2·12288), down
QWEN3_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def random_w4(rng, kind: str, N: int, K: int, group: int, lead: tuple[int, ...] = ()) -> fmt.W4Codes:
    codes = rng.integers(0, 16, (*lead, N, K)).astype(np.uint8)
    G = K // group
    if kind == "fp4":
        e = rng.integers(118, 130, (*lead, N, G)).astype(np.uint8)
        return fmt.W4Codes(codes, fmt.ue8m0_to_bf16_bits(e), fmt.BF16, None, group, fp4=True)
    if kind == "bf16":
        scales = rng.uniform(0.01, 0.1, (*lead, N, G)).astype(np.float32).astype(ml_dtypes.bfloat16)
        return fmt.W4Codes(codes, scales.view(np.uint16), fmt.BF16, None, group)
    if kind not in ("fp16", "fp16_zero"):
        raise ValueError(f"kind {kind!r}: one of {W4_KINDS}")
    scales = rng.uniform(0.005, 0.1, (*lead, N, G)).astype(np.float16).view(np.uint16)
    zeros = rng.integers(0, 17, (*lead, N, G)).astype(np.uint8) if kind == "fp16_zero" else None
    return fmt.W4Codes(codes, scales, fmt.FP16, zeros, group)


def random_fp8_weight(rng, N: int, K: int, channel: bool) -> tuple[np.ndarray, np.ndarray]:
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    if channel:
        ws = (np.abs(w).max(1) / 448).astype(np.float32)
        return (w / ws[:, None]).astype(ml_dtypes.float8_e4m3fn), ws
    return quantize_fp8_block(w, (128, 128))


def grouped_layout(counts, tile_m: int, spare_tiles: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """moe_align's layout of `counts` rows an expert: each expert's rows at the top of its whole tiles, empty
    experts no tile, `spare_tiles` padding tiles at the end repeating the last expert (the fixed grid's)."""
    tile_expert, row_token = [], []
    for e, c in enumerate(counts):
        tiles = -(-int(c) // tile_m)
        tile_expert += [e] * tiles
        row_token += list(range(c)) + [-1] * (tiles * tile_m - c)
    tile_expert += [tile_expert[-1]] * spare_tiles
    row_token += [-1] * (spare_tiles * tile_m)
    return np.array(tile_expert, np.int32), np.array(row_token, np.int32)
