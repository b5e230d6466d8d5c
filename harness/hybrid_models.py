"""Tiny random-weight Qwen3.5 (hybrid: Gated DeltaNet + gated attention) folders for the gates, in both
checkpoint forms, and their transformers float32 oracle (needs torch and transformers).

    from harness.hybrid_models import HYBRID_MODELS, hybrid_model_path, hybrid_hf_logits

Weights as harness.models.randomize_ draws them, except: the (1 + w) RMSNorms' w ~ N(0, 0.2) (a scale
near 1, as the zero-centred norms are trained; randomize_'s 1 + N(0, 0.2) would double every scale and
make the model chaotic: float32 rounding alone then moved logprobs by 1e-3), and decays drawn moderate
(g ~ -0.01 .. -0.5 per token) so that the recurrent state carries across tens of tokens and a chunk or
step boundary that loses it shows in the logits.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from harness.models import _tmp_root, in_vocab, randomize_, save_tiny, tokenizer_source

# name -> (composite form?, text config overrides)
HYBRID_MODELS: dict[str, tuple[bool, dict]] = {
    # full attention second of 4 (not at the end); Hq 3 / Hkv 1; linear 1 key head / 3 value heads,
    # Dk 16 != Dv 8; rotary on 8 of 32 dims; tied lm_head; text-only checkpoint (model.*)
    "qwen3_5_text": (False, dict(num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                                 linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16,
                                 linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                                 layer_types=["linear_attention", "full_attention", "linear_attention",
                                              "linear_attention"],
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.25})),
    # composite checkpoint (model.language_model.*, a vision tower beside it); Hq 5 / Hkv 1; linear 3 / 3
    # heads, Dk 8 != Dv 16; conv width 3; rotary on 8 of 16 dims; untied
    "qwen3_5": (True, dict(num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, head_dim=16,
                           linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8,
                           linear_value_head_dim=16, linear_conv_kernel_dim=3, tie_word_embeddings=False,
                           layer_types=["linear_attention", "linear_attention", "full_attention",
                                        "linear_attention"],
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                            "partial_rotary_factor": 0.5})),
}
_TEXT_BASE = dict(hidden_size=64, intermediate_size=96, max_position_embeddings=512, rms_norm_eps=1e-6)
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    num_position_embeddings=16)


def _hybrid_weights_(model, seed: int) -> None:
    """(1 + w) norms: w ~ N(0, 0.2); A = exp(A_log) in [0.02, 0.2], dt_bias ~ N(0, 0.5), in_proj_a rows
    scaled by 0.3."""
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name and "visual" not in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.2, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("in_proj_a.weight"):
                p.mul_(0.3)


def hf_config(composite: bool, text: dict, vocab: int, bos: int, eos: int):
    """The transformers config of a hybrid model: text overrides on the tiny base, text-only or composite."""
    import transformers
    text = {**_TEXT_BASE, **text, "vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos}
    if not composite:
        return transformers.Qwen3_5TextConfig(**text)
    return transformers.Qwen3_5Config(text_config=text, vision_config=_TINY_VISION,
                                      tie_word_embeddings=text["tie_word_embeddings"])


def build_hybrid_model(name: str, out_dir: str, seed: int = 0, vocab: int | None = None) -> str:
    """Save tiny hybrid model `name` as an HF folder (bf16) with the real tokenizer (vocab: as build_config_model)."""
    return build_hybrid_config(*HYBRID_MODELS[name], out_dir, seed, vocab)


def build_hybrid_config(composite: bool, text: dict, out_dir: str, seed: int = 0, vocab: int | None = None) -> str:
    """Save a tiny hybrid model of hf_config(composite, text) as an HF folder (bf16) with the real tokenizer."""
    import torch
    import transformers
    _, rows, bos, eos = tokenizer_source()
    vocab = vocab or rows
    config = hf_config(composite, text, vocab, in_vocab(bos, vocab), in_vocab(eos, vocab))
    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if composite else transformers.AutoModelForCausalLM
    model = auto.from_config(config)
    randomize_(model, seed)
    _hybrid_weights_(model, seed)
    return save_tiny(model, out_dir)


@functools.lru_cache(maxsize=None)
def hybrid_model_path(name: str) -> str:
    """The folder of tiny hybrid model `name`, built once per process."""
    return build_hybrid_model(name, os.path.join(_tmp_root(), name))


@functools.lru_cache(maxsize=4)
def hybrid_hf_model(path: str, dtype: str = "float32"):
    """transformers oracle (eager attention; the torch fallbacks of the conv and the delta rule where
    flash-linear-attention / causal-conv1d are not installed). The composite form loads as
    Qwen3_5ForConditionalGeneration, so its lm_head ties as the composite config says."""
    import json

    import torch
    import transformers
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        composite = json.load(f).get("model_type") == "qwen3_5"
    auto = transformers.AutoModelForImageTextToText if composite else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    return model.eval()


def hybrid_hf_logits(path: str, ids: list[int], dtype: str = "float32") -> np.ndarray:
    """float32 logits [T, V] of one sequence (one forward, no cache: HF's chunked delta rule)."""
    import torch
    with torch.no_grad():
        out = hybrid_hf_model(path, dtype)(input_ids=torch.tensor([ids])).logits[0]
    return out.float().numpy()
