"""Quantized copies of HF model folders, in the formats real checkpoints ship (for the tests and the
benchmarks; the engine only reads them, engine/loader/quantized.py):

* `fp8_folder`: every 2-D projection weight of the decoder layers as float8 e4m3 with float32
  `weight_scale_inv` per [bn, bk] block (DeepSeek-V3's; amax / 448 per block, a last partial block
  kept) and quantization_config {"quant_method": "fp8", "weight_block_size": [bn, bk]}.
* `fp8_channel_folder`: the same projections as compressed-tensors `float-quantized` fp8 with one float32
  `weight_scale` per output row ([N, 1], amax / 448: what vLLM's --quantization fp8 computes at load).
* `int4_folder`: the layers' projections as AWQ (gemm version: asymmetric, zero points, qweight [K, N/8] in
  AutoAWQ's nibble order) or GPTQ (v1: symmetric, qweight [K/8, N], zeros minus one) int4, group 128, fp16
  scales; also writes `reference`: the same folder in float32 holding the dequantized values (q - z) · s.
* `int4_experts_folder`: the routed experts' projections as compressed-tensors `pack-quantized` symmetric
  int4 with bf16 group scales (Kimi-K2-Thinking's): weight_packed / weight_scale / weight_shape, the rest
  as it was. Also writes `reference`: the same folder in bf16 holding the dequantized values, which are
  exact in bf16 (int4 times a bf16 scale, rounded to bf16 as compressed-tensors multiplies).

The packing here is written bit by bit, apart from the loader's vectorized unpacking.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np

from engine.loader.safetensors_io import SafetensorsCheckpoint, save_safetensors

FP8_MAX = 448.0
LAYER_LINEAR = re.compile(r"model\.layers\.\d+\..*(proj|proj_with_mqa)\.weight$")
EXPERT_LINEAR = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 e4m3 [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]) with w ~ fp8 · scale_inv per block."""
    w = np.asarray(w, np.float32)
    (N, K), (bn, bk) = w.shape, block
    gn, gk = -(-N // bn), -(-K // bk)
    scale_inv = np.ones((gn, gk), np.float32)
    q = np.empty((N, K), ml_dtypes.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = float(np.abs(tile).max())
            scale_inv[i, j] = amax / FP8_MAX if amax > 0 else 1.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scale_inv[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv


def pack_int32_bitwise(q: np.ndarray, bits: int) -> np.ndarray:
    """Signed values q [N, K] in int32 words, element k at bit position k·bits of its row (value + 2^(bits-1))."""
    N, K = q.shape
    words = np.zeros((N, -(-K * bits // 32)), np.uint32)
    for n in range(N):
        for k in range(K):
            u = int(q[n, k]) + (1 << (bits - 1))
            for b in range(bits):
                pos = k * bits + b
                words[n, pos // 32] |= np.uint32(((u >> b) & 1) << (pos % 32))
    return words.view(np.int32)


def quantize_int_group(w: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 [N, K], scale bf16 [N, K / group], dequantized float32 [N, K]): symmetric, scale = amax / qmax."""
    w = np.asarray(w, np.float32)
    N, K = w.shape
    qmax = (1 << (bits - 1)) - 1
    g = w.reshape(N, K // group, group)
    scale = (np.abs(g).max(-1) / qmax).astype(ml_dtypes.bfloat16)
    s = np.where(scale.astype(np.float32) > 0, scale.astype(np.float32), 1.0)[..., None]
    q = np.clip(np.round(g / s), -qmax - 1, qmax).astype(np.int8).reshape(N, K)
    deq = (q.reshape(N, K // group, group) * scale.astype(np.float32)[..., None]).reshape(N, K)
    return q, scale, deq.astype(ml_dtypes.bfloat16).astype(np.float32)


def _rewrite(src: str, dst: str, tensors: dict[str, np.ndarray], quantization_config: dict | None) -> str:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    save_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    if quantization_config is not None:
        path = os.path.join(dst, "config.json")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["quantization_config"] = quantization_config
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
    return dst


def read_tensors(src: str) -> dict[str, np.ndarray]:
    """Every tensor of HF folder src, as copies (the folder may be rewritten from them)."""
    ckpt = SafetensorsCheckpoint(src)
    return {k: np.array(ckpt.get(k)) for k in ckpt.keys()}


def fp8_folder(src: str, dst: str, block: tuple[int, int] = (128, 128), quantize=quantize_fp8_block) -> str:
    """A copy of HF folder src with its layers' projections in FP8 with block scales (quantize(w, block): the
    block quantizer, e.g. a vectorized one for real shapes)."""
    out = {}
    for name, a in read_tensors(src).items():
        if LAYER_LINEAR.match(name) and a.ndim == 2:
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = quantize(a, block)
        else:
            out[name] = a
    return _rewrite(src, dst, out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(block)})


def quantize_fp8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 e4m3 [N, K], scale float32 [N, 1]) with w ~ fp8 · scale per row (amax / 448; 1 for a zero row)."""
    w = np.asarray(w, np.float32)
    scale = np.empty((w.shape[0], 1), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for n in range(w.shape[0]):
        amax = float(np.abs(w[n]).max())
        scale[n, 0] = np.float32(amax) / np.float32(FP8_MAX) if amax > 0 else 1.0
        q[n] = np.clip(w[n] / scale[n, 0], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def fp8_channel_folder(src: str, dst: str) -> str:
    """A copy of HF folder src with its layers' projections in compressed-tensors float-quantized fp8
    (channel weight scales, dynamic per-token activations)."""
    out = {}
    for name, a in read_tensors(src).items():
        if LAYER_LINEAR.match(name) and a.ndim == 2:
            out[name], out[name[:-len("weight")] + "weight_scale"] = quantize_fp8_channel(a)
        else:
            out[name] = a
    scheme = {"weights": {"type": "float", "num_bits": 8, "symmetric": True, "strategy": "channel",
                          "dynamic": False},
              "input_activations": {"type": "float", "num_bits": 8, "symmetric": True, "strategy": "token",
                                    "dynamic": True},
              "targets": ["Linear"]}
    return _rewrite(src, dst, out, {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]})


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # AutoAWQ's: word c's nibble i holds column 8c + order[i]


def pack_words(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """Nibbles [..., 8·W] into int32 words [..., W]: word c holds value 8c + order[i] in bits 4i."""
    v = values.astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], np.uint32)
    for i, j in enumerate(order):
        words |= v[..., j] << np.uint32(4 * i)
    return words.view(np.int32)


def quantize_int4(w: np.ndarray, group: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [N, K] 0..15, zeros [N, K/g] (8 where symmetric), scales fp16 [N, K/g]) with w ~ (q - z) · s per group:
    symmetric s = amax / 7; else s = (max - min) / 15, z = round(-min / s)."""
    w = np.asarray(w, np.float32)
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    if symmetric:
        s = np.maximum(np.abs(g).max(-1) / 7, 1e-6).astype(np.float16)
        z = np.full(s.shape, 8, np.int64)
    else:
        lo, hi = g.min(-1), g.max(-1)
        s = np.maximum((hi - lo) / 15, 1e-6).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float32)), 0, 15).astype(np.int64)
    q = np.clip(np.round(g / s.astype(np.float32)[..., None]) + z[..., None], 0, 15).astype(np.int64)
    return q.reshape(N, K), z, s


def int4_folder(src: str, dst: str, reference: str | None, method: str, group: int = 128) -> tuple[str, str | None]:
    """(dst: src with its layers' projections in AWQ ("awq") or GPTQ v1 ("gptq") int4, reference: the same
    weights dequantized in float32; None: not written)."""
    packed, plain = {}, {}
    for name, a in read_tensors(src).items():
        if not (LAYER_LINEAR.match(name) and a.ndim == 2):
            packed[name] = plain[name] = a
            continue
        q, z, s = quantize_int4(a, group, symmetric=method == "gptq")
        base = name[:-len("weight")]
        if method == "awq":
            packed.update({base + "qweight": pack_words(q.T, AWQ_PACK_ORDER), base + "scales": s.T.copy(),
                           base + "qzeros": pack_words(z.T, AWQ_PACK_ORDER)})
        else:
            packed.update({base + "qweight": pack_words(q).T.copy(), base + "qzeros": pack_words(z.T - 1),
                           base + "scales": s.T.copy(), base + "g_idx": np.arange(a.shape[1], dtype=np.int32) // group})
        if reference is not None:
            plain[name] = ((q - np.repeat(z, group, 1)) * np.repeat(s.astype(np.float32), group, 1)).astype(np.float32)
    config = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
              if method == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                       "sym": True, "checkpoint_format": "gptq"})
    return _rewrite(src, dst, packed, config), reference and _rewrite(src, reference, plain, None)


def int4_experts_folder(src: str, dst: str, reference: str, group: int = 32) -> tuple[str, str]:
    """(dst: src with its routed experts in compressed-tensors int4, reference: the same weights dequantized
    in bf16)."""
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]
    return packed_int4_folder(src, dst, reference, EXPERT_LINEAR, group, ignore)


def packed_int4_folder(src: str, dst: str, reference: str, pattern: re.Pattern, group: int = 32,
                       ignore: tuple[str, ...] = ("lm_head",)) -> tuple[str, str]:
    """(dst: src with the weights `pattern` matches in compressed-tensors pack-quantized int4 (symmetric, `group`),
    the others (`ignore`: their config entry) left unquantized; reference: the same weights dequantized, in their
    own dtype)."""
    packed, plain = {}, {}
    for name, a in read_tensors(src).items():
        if not pattern.match(name):
            packed[name] = plain[name] = a
            continue
        q, scale, deq = quantize_int_group(a, 4, group)
        base = name[:-len("weight")]
        packed.update({base + "weight_packed": pack_int32_bitwise(q, 4), base + "weight_scale": scale,
                       base + "weight_shape": np.array(a.shape, np.int64)})
        plain[name] = deq.astype(a.dtype)
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                  "dynamic": False, "observer": "minmax"}}},
              "ignore": list(ignore)}
    return _rewrite(src, dst, packed, config), _rewrite(src, reference, plain, None)


def dequantized_copy(src: str, dst: str) -> str:
    """src (a quantized folder) with every quantized weight replaced by its float32 dequantization (the
    loader's, which the CPU tests hold bit-identical to transformers'), without quantization_config: a
    folder any transformers build loads as a plain model (the GPU tests' oracle)."""
    from engine.loader.quantized import dequantizing

    ckpt = SafetensorsCheckpoint(src)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    has, get = dequantizing(cfg, ckpt.__contains__, ckpt.get)
    suffixes = ("weight_scale_inv", "weight_packed", "weight_scale", "weight_shape")
    names = {k if not k.endswith(suffixes) else k[:k.rindex(".")] + ".weight" for k in ckpt.keys()}
    out = {k: np.asarray(get(k), np.float32) if k.endswith(".weight") else np.array(ckpt.get(k)) for k in names}
    _rewrite(src, dst, out, None)
    cfg.pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return dst
