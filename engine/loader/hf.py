"""Load a Hugging Face model folder: config, weights (stored dtype, memory-mapped), tokenizer,
generation config."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM
from engine.models.registry import build_model
from engine.models.weights import pack_weights
from engine.loader.quantized import dequantizing
from engine.loader.safetensors_io import SafetensorsCheckpoint
from engine.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]          # engine names (see model.weight_specs()), stored dtype
    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    path: str                               # the HF folder the model was loaded from
    model: DecoderLM = field(repr=False, default=None)  # type: ignore[assignment]


def read_generation_config(folder: str, config: ModelConfig) -> dict[str, Any]:
    path = os.path.join(folder, "generation_config.json")
    gen: dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    if gen.get("eos_token_id") is None and config.eos_token_id is not None:
        gen["eos_token_id"] = config.eos_token_id
    return gen


def load_hf_folder(folder: str, dequant_dtype=np.float32) -> LoadedModel:
    """dequant_dtype: what quantized weights (FP8, packed int) are dequantized to (loader/quantized.py)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder not found: {folder}")
    config = ModelConfig.from_file(folder)
    model = build_model(config)
    ckpt = SafetensorsCheckpoint(folder)
    has, get = model.checkpoint(*dequantizing(config.raw, ckpt.__contains__, ckpt.get, dequant_dtype))
    weights = pack_weights(model.weight_specs(), has, get, where=folder)
    gen = read_generation_config(folder, config)
    tokenizer = Tokenizer.from_folder(folder, gen)
    return LoadedModel(config, weights, tokenizer, gen, os.path.abspath(folder), model)
