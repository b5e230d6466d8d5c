"""Tiny random folders with a multi-token-prediction module in their line's layout, written here and not from the
engine's loader, so the loader is checked against them:
  * DeepSeek-V3 / Kimi-K2 (README_WEIGHTS.md; vLLM's deepseek_mtp.py): transformers builds the model with one
    layer more, whose decoder block becomes the module's at model.layers.{L} (L = num_hidden_layers once the
    config says one layer fewer and num_nextn_predict_layers 1); the module's own tensors (transformers creates
    none) are added with the layout's shapes.
  * Qwen3.5 (vLLM's qwen3_5_mtp.py): built with a full-attention layer more, which moves to mtp.layers.0
    (mtp_num_hidden_layers 1); mtp.fc, mtp.pre_fc_norm_embedding / _hidden and mtp.norm added.

    from harness.mtp_models import write_mtp_model, write_qwen35_mtp_model
    folder = write_mtp_model("deepseek_v3", out_dir)
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from engine.loader.safetensors_io import save_safetensors
from harness.hybrid_models import HYBRID_MODELS, build_hybrid_config
from harness.models import DSV3_MODELS, build_tiny_model
from harness.quantized import read_tensors


def mtp_shapes(hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The module's own tensors (beside its decoder block) under model.layers.{L}."""
    return {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
            "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (vocab, hidden),
            "embed_tokens.weight": (vocab, hidden)}


def write_mtp_model(name: str, out_dir: str, seed: int = 0, ship_head: bool = True, **overrides) -> str:
    """DSV3_MODELS[name] with one MTP module: matrices ~ N(0, 1/fan_in) scaled 1.5, norms ~ 1 + N(0, 0.2), the
    embedding copy equal to the model's; ship_head False leaves shared_head.head out (lm_head serves)."""
    layers = {**DSV3_MODELS[name][1], **overrides}["num_hidden_layers"]
    build_tiny_model(name, out_dir, seed=seed, **{**overrides, "num_hidden_layers": layers + 1})
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    tensors = read_tensors(out_dir)
    rng = np.random.default_rng(seed + 1)
    for short, shape in mtp_shapes(config["hidden_size"], config["vocab_size"]).items():
        if short == "shared_head.head.weight" and not ship_head:
            continue
        a = (tensors["model.embed_tokens.weight"] if short == "embed_tokens.weight" else
             1 + 0.2 * rng.standard_normal(shape) if len(shape) == 1 else
             rng.standard_normal(shape) * (1.5 / shape[-1] ** 0.5))
        tensors[f"model.layers.{layers}.{short}"] = np.asarray(a).astype(ml_dtypes.bfloat16)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    return out_dir


def qwen35_mtp_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """The Qwen3.5 module's own tensors (beside its layer mtp.layers.0)."""
    return {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
            "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}


def write_qwen35_mtp_model(name: str, out_dir: str, seed: int = 0) -> str:
    """HYBRID_MODELS[name] with one MTP module: its layer as transformers draws a full-attention layer (the hybrid
    models' weights), fc ~ N(0, 1/fan_in) scaled 1.5, the (1 + w) norms' w ~ N(0, 0.2)."""
    composite, text = HYBRID_MODELS[name]
    layers = text["num_hidden_layers"]
    build_hybrid_config(composite, {**text, "num_hidden_layers": layers + 1,
                                    "layer_types": text["layer_types"] + ["full_attention"]}, out_dir, seed=seed)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    cfg = config["text_config"] if composite else config
    cfg.update(num_hidden_layers=layers, layer_types=text["layer_types"], mtp_num_hidden_layers=1)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    tensors = read_tensors(out_dir)
    block = f"model.language_model.layers.{layers}." if composite else f"model.layers.{layers}."
    for key in [k for k in tensors if k.startswith(block)]:
        tensors["mtp.layers.0." + key[len(block):]] = tensors.pop(key)
    rng = np.random.default_rng(seed + 1)
    for key, shape in qwen35_mtp_shapes(cfg["hidden_size"]).items():
        a = 0.2 * rng.standard_normal(shape) if len(shape) == 1 else rng.standard_normal(shape) * (1.5 / shape[-1] ** 0.5)
        tensors[key] = np.asarray(a).astype(ml_dtypes.bfloat16)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    return out_dir
