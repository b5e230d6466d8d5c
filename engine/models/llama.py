"""The Llama family: Llama (optional attention bias on q, k, v and o) and Qwen2 (bias on q, k, v
only). No q/k norm; rope scaling (linear, llama3, yarn) comes from engine/models/rope.py.
The forward is the pre-norm decoder_stack of engine/models/decoder.py, without q/k norm.
"""
from __future__ import annotations

from engine.model_config import ModelConfig
from engine.models.decoder import DENSE_LINEARS, DecoderLM, LayerOptions


class LlamaForCausalLM(DecoderLM):
    model_type = "llama"
    piecewise_graphs = True
    layerwise_restore = True
    lora = True
    kept_quantized = DENSE_LINEARS
    tensor_parallel = True

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        return LayerOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_type = "qwen2"

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        return LayerOptions(qkv_bias=True, o_bias=False, qk_norm=False)
