"""Load a Hugging Face model folder: config, weights (stored dtype, memory-mapped), tokenizer,
generation config."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.model_config import ModelConfig
from engine.model_files import ModelLoadError, read_json_object
from engine.models.decoder import DecoderLM
from engine.models.quant_linear import Fp8Linear
from engine.models.registry import build_model
from engine.models.weights import pack_weights
from engine.loader.kept_linear import linear_keeper
from engine.loader.quantized import dequantizing, quant_format
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
    quantization: str | None = None         # the --quantization it was loaded with (each GPU rank loads it so)


def read_generation_config(folder: str, config: ModelConfig) -> dict[str, Any]:
    gen = read_json_object(os.path.join(folder, "generation_config.json"), required=False)
    if gen.get("eos_token_id") is None and config.eos_token_id is not None:
        gen["eos_token_id"] = config.eos_token_id
    return gen


def read_weights(ckpt: SafetensorsCheckpoint, model: DecoderLM, specs_of: Callable[[Callable], list], dtype,
                 where: str, keep=None) -> dict:
    """The packed weights specs_of(has) from the checkpoint as the model names it (has: its names), quantized
    ones dequantized to dtype (keep: those kept quantized, loader/kept_linear.py); ModelLoadError for a tensor
    the model needs that is not in the checkpoint."""
    has, get = model.checkpoint(*dequantizing(model.config.raw, ckpt.__contains__, ckpt.get, dtype))
    specs = specs_of(has)
    try:
        return pack_weights(specs, has, get, where=where, keep=keep)
    except KeyError as e:
        raise ModelLoadError(e.args[0]) from None


def load_hf_folder(folder: str, dequant_dtype=np.float32, quantization: str | None = None,
                   keep_quantized: bool = True) -> LoadedModel:
    """dequant_dtype: what quantized weights (FP8, packed int) are dequantized to (loader/quantized.py);
    quantization: vLLM's --quantization ("fp8": the line's linear layers quantized at load); keep_quantized:
    the line's linear layers in a kept format load kept (loader/kept_linear.py), else dequantized too."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder not found: {folder}")
    config = ModelConfig.from_file(folder)
    model = build_model(config)
    ckpt = SafetensorsCheckpoint(folder)
    keeper = linear_keeper(quant_format(config.raw), quantization, model,
                           *model.checkpoint(ckpt.__contains__, ckpt.get)) if keep_quantized else None
    weights = read_weights(ckpt, model, lambda has: model.weight_specs(), dequant_dtype, folder,
                           keeper and keeper.keep)
    if quantization is not None and not any(isinstance(w, Fp8Linear) for w in weights.values()):
        raise ValueError(f"--quantization {quantization}: no linear layer of {folder} can be quantized (W8A8 needs "
                         f"input widths that are multiples of 128)")
    gen = read_generation_config(folder, config)
    tokenizer = Tokenizer.from_folder(folder, gen)
    return LoadedModel(config, weights, tokenizer, gen, os.path.abspath(folder), model, quantization)
