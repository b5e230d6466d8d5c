"""The FP8 KV cache's per-tensor scales from a checkpoint (memory/kv_format.py), under the names vLLM reads
(its maybe_remap_kv_scale_name): `model.layers.{i}.self_attn.k_scale` / `v_scale` (ModelOpt, compressed-tensors'
kv_cache_scheme), `self_attn.attn.k_scale`, and `self_attn.k_proj.output_scale` / `v_proj.output_scale` (Quark,
older compressed-tensors). A layer without one keeps 1.0, as vLLM does.
"""
from __future__ import annotations

import os

import numpy as np

from engine.loader.safetensors_io import SafetensorsCheckpoint
from memory.kv_format import KVFormat, is_fp8

PLANE_NAMES = (("k_scale", "attn.k_scale", "k_proj.output_scale"), ("v_scale", "attn.v_scale", "v_proj.output_scale"))


def check_kv_cache_scheme(raw_config: dict) -> None:
    """Refuse a quantization_config.kv_cache_scheme whose scales are not per tensor (one per layer and plane)."""
    scheme = (raw_config.get("quantization_config") or {}).get("kv_cache_scheme")
    if scheme and (scheme.get("strategy", "tensor") != "tensor" or scheme.get("type", "float") != "float"
                   or int(scheme.get("num_bits", 8)) != 8):
        raise ValueError(f"quantization_config.kv_cache_scheme {scheme}: only per-tensor 8-bit float KV scales "
                         f"are served")


def checkpoint_kv_scales(folder: str | None, kv_layers: dict[int, int], planes: int) -> np.ndarray | None:
    """float32 [KV layers, planes] from the checkpoint in folder (kv_layers: decoder layer -> its KV layer);
    None where the checkpoint has no KV scale at all (or is not a safetensors folder)."""
    if not folder or not os.path.isdir(folder):
        return None
    try:
        ckpt = SafetensorsCheckpoint(folder)
    except (FileNotFoundError, ValueError):
        return None
    scales = np.ones((max(kv_layers.values(), default=-1) + 1, planes), np.float32)
    found = False
    for layer, kv_layer in kv_layers.items():
        for plane in range(planes):
            for name in (f"model.layers.{layer}.self_attn.{n}" for n in PLANE_NAMES[plane]):
                if name in ckpt:
                    scales[kv_layer, plane] = float(np.asarray(ckpt.get(name), np.float32).reshape(-1)[0])
                    found = True
                    break
    return scales if found else None


def kv_format_of(kv_cache_dtype: str, loaded) -> KVFormat:
    """The KV format an executor stores for a LoadedModel under --kv-cache-dtype; raises ValueError naming
    the flag where the line's KV cannot be FP8."""
    model = loaded.model
    layout = model.kv_layout()
    if not is_fp8(kv_cache_dtype):
        return KVFormat()
    if not model.fp8_kv_cache:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: the {model.model_type or type(model).__name__} "
                         f"line's KV rows cannot be stored as FP8 (use auto)")
    check_kv_cache_scheme(loaded.config.raw)
    scales = checkpoint_kv_scales(loaded.path, model.kv_layers(), layout.planes)
    return KVFormat.of(kv_cache_dtype, layout.layers, layout.planes, scales)
