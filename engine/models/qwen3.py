"""Qwen3 dense: GQA with an explicit head_dim, per-head RMSNorm on q and k before rotary,
tied or untied lm_head, optional attention bias."""
from __future__ import annotations

from typing import Any

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM, LayerOptions, decoder_stack
from engine.models.ops import Array, Ops


class Qwen3ForCausalLM(DecoderLM):
    model_type = "qwen3"

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        return LayerOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)

    def forward(self, ops: Ops, w: dict[str, Array], ctx: Any) -> Array:
        return decoder_stack(ops, w, ctx, self.config, self.attention_specs, self.opt)
