"""The model registry: model_type -> model line, in one table. Everything that lists the supported model
types (config validation and its message, the CLI help, tests) reads MODEL_REGISTRY.

A line is named by its module and class and imported on first use, so the table imports no model code:
engine/model_config.py validates against it, and a line's module imports ModelConfig.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from engine.model_config import ModelConfig
    from engine.models.decoder import DecoderLM

# model_type (config.json's) -> (module under engine/models/, class)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "Qwen2ForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM"),     # Kimi-K2: DeepSeek-V3's architecture, its own name
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM"),  # the GPU in eager steps
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
}


def supported_model_types() -> tuple[str, ...]:
    """The model types served, in the table's order."""
    return tuple(MODEL_REGISTRY)


def model_class(model_type: str) -> type[DecoderLM]:
    """The line serving `model_type`; ValueError naming the supported types for any other."""
    try:
        module, name = MODEL_REGISTRY[model_type]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported model_type {model_type!r}; "
                         f"supported: {', '.join(supported_model_types())}") from None
    return getattr(importlib.import_module(f"engine.models.{module}"), name)     # imported only when served


def model_types_where(has: Callable[[type[DecoderLM]], bool]) -> tuple[str, ...]:
    """The model types whose line has what `has` asks of its class (e.g. `lambda line: line.lora`)."""
    return tuple(t for t in MODEL_REGISTRY if has(model_class(t)))


def build_model(config: ModelConfig) -> DecoderLM:
    return model_class(config.model_type)(config)
