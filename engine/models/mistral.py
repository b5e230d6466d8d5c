"""Mistral (Mistral-7B v0.2 / v0.3, Mistral-Nemo, Mistral-Small): Llama's decoder without attention bias,
with head_dim as the config gives it (Nemo's 128 != hidden / heads). Its attention may be limited to a
sliding window: within the window that is full attention, so a config whose window is shorter than its
context (v0.1's 4096 of 32768) is refused rather than served wrong beyond the window.
"""
from __future__ import annotations

from typing import Any

from engine.model_config import ModelConfig
from engine.models.decoder import LayerOptions
from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    model_type = "mistral"

    @staticmethod
    def config_fields(d: dict[str, Any]) -> dict[str, Any]:
        window, context = d.get("sliding_window"), d.get("max_position_embeddings") or 4096
        if window is not None and window < context:
            raise ValueError(f"unsupported: sliding-window attention (mistral sliding_window {window} is "
                             f"shorter than max_position_embeddings {context})")
        return d

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        return LayerOptions(qkv_bias=False, o_bias=False, qk_norm=False)
