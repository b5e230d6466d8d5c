"""model_type -> model line."""
from __future__ import annotations

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM
from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

MODEL_REGISTRY: dict[str, type[DecoderLM]] = {
    "qwen3": Qwen3ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,           # Kimi-K2: DeepSeek-V3's architecture under its own name
    "deepseek_v4": DeepseekV4ForCausalLM,       # the GPU in eager steps
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5": Qwen3_5ForConditionalGeneration,
}


def build_model(config: ModelConfig) -> DecoderLM:
    try:
        cls = MODEL_REGISTRY[config.model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {config.model_type!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None
    return cls(config)
