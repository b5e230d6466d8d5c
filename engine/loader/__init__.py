"""Model loading: `load_model(path)` takes a Hugging Face folder or a .gguf file (converted once
into a cached HF folder) and returns a LoadedModel."""
from __future__ import annotations

import os

import numpy as np

from engine.loader.hf import LoadedModel, load_hf_folder


def load_model(path: str, dequant_dtype=np.float32, quantization: str | None = None,
               keep_quantized: bool = True) -> LoadedModel:
    """Load an HF model folder, or a GGUF file (converted on first use, cached); quantized weights are
    kept where the line serves them quantized (engine/loader/kept_linear.py; keep_quantized False: never),
    the rest dequantized to dequant_dtype (engine/loader/quantized.py); quantization: vLLM's --quantization."""
    path = os.path.expanduser(str(path))
    if path.endswith(".gguf"):
        from engine.loader.gguf_convert import convert_gguf
        path = convert_gguf(path)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {path}")
    return load_hf_folder(path, dequant_dtype, quantization, keep_quantized)


__all__ = ["LoadedModel", "load_model"]
