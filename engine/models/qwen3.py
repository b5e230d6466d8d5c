"""Qwen3 dense: GQA with an explicit head_dim, per-head RMSNorm on q and k before rotary,
tied or untied lm_head, optional attention bias (on q, k, v and o).

Forward (decoder_stack): embed -> per layer [RMSNorm + fused qkv GEMM -> q/k norm + rope +
paged-KV write -> paged attention -> o_proj + residual add -> RMSNorm + fused gate_up GEMM -> silu*up
-> down_proj + residual add] -> final RMSNorm -> lm_head.
"""
from __future__ import annotations

from engine.model_config import ModelConfig
from engine.models.decoder import DENSE_LINEARS, DecoderLM, LayerOptions


class Qwen3ForCausalLM(DecoderLM):
    model_type = "qwen3"
    piecewise_graphs = True
    layerwise_restore = True
    lora = True
    kept_quantized = DENSE_LINEARS
    tensor_parallel = True

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        return LayerOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)
