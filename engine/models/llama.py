"""The Llama family: Llama (optional attention bias on q, k, v and o) and Qwen2 (bias on q, k, v
only). No q/k norm; rope scaling (linear, llama3, yarn) comes from engine/models/rope.py."""
from __future__ import annotations

from typing import Any

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM, LayerOptions, decoder_stack
from engine.models.ops import Array, Ops


class LlamaForCausalLM(DecoderLM):
    model_type = "llama"

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        return LayerOptions(qkv_bias=config.qkv_bias, o_bias=config.o_bias, qk_norm=False)

    def forward(self, ops: Ops, w: dict[str, Array], ctx: Any) -> Array:
        return decoder_stack(ops, w, ctx, self.config, self.attention_specs, self.opt)


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_type = "qwen2"
