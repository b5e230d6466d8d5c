"""The FP8 KV cache's oracle: transformers' own float32 model with K and V rounded through e4m3 as vLLM stores
them (x / scale saturated to ±448, e4m3, times scale) where its cache holds them, and its bf16 / float32
logits beside it for the floor (DESIGN.md).

Dense lines: an attention function registered with transformers' AttentionInterface rounds the cached keys
(after rotary) and values, then runs the line's own eager attention. MLA lines (DeepSeek-V2 / V3): the
latent (kv_a_layernorm's output) and the rotated rope key are rounded, the two parts of the latent row the
engine stores.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np

FP8_KV_ATTENTION = "fp8_kv_eager"


def e4m3_roundtrip(t, scale: float):
    """t as the FP8 cache returns it: e4m3(t / scale) saturated, times scale, in t's dtype."""
    import torch

    q = (t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(t.dtype)


def register_fp8_kv_attention(scales: np.ndarray) -> str:
    """Register the rounding attention for KV scales [layers, 2] (HF layer_idx -> k_scale, v_scale); returns
    the attn_implementation name to load a dense model with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = (float(s) for s in scales[module.layer_idx])
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, e4m3_roundtrip(key, k_scale), e4m3_roundtrip(value, v_scale), attention_mask,
                     **kwargs)

    AttentionInterface.register(FP8_KV_ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FP8_KV_ATTENTION, eager_mask)       # the additive mask eager reads
    return FP8_KV_ATTENTION


@contextlib.contextmanager
def mla_fp8_latent(model, scales: np.ndarray):
    """Within: the MLA model's latent and rope key rounded through e4m3 with each layer's k_scale (scales
    [layers, 1]), as the engine's latent cache stores them."""
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    names = [n for n in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb") if hasattr(module, n)]
    saved = {n: getattr(module, n) for n in names}
    current = {"scale": 1.0}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn, scale = layer.self_attn, float(scales[i, 0])

        def pre(mod, args, kwargs, scale=scale):
            current["scale"] = scale
        hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(attn.kv_a_layernorm.register_forward_hook(
            lambda mod, args, out, scale=scale: e4m3_roundtrip(out, scale)))

    def rounding(rope):
        def apply(q, k, *args, **kwargs):
            q, k = rope(q, k, *args, **kwargs)
            return q, e4m3_roundtrip(k, current["scale"])
        return apply

    for n in names:
        setattr(module, n, rounding(saved[n]))
    try:
        yield model
    finally:
        for n in names:
            setattr(module, n, saved[n])
        for h in hooks:
            h.remove()


def hf_fp8_kv_logits(path: str, seqs: list[list[int]], scales: np.ndarray, mla: bool = False,
                     dtype: str = "float32") -> list[np.ndarray]:
    """transformers' logits (float32 or bfloat16 model, as float32) of each sequence with its KV rounded through
    e4m3 (scales [layers, planes])."""
    import torch
    from transformers import AutoModelForCausalLM

    impl = "eager" if mla else register_fp8_kv_attention(scales)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=impl).eval()
    rounding = mla_fp8_latent(model, scales) if mla else contextlib.nullcontext()
    with torch.no_grad(), rounding:
        return [model(torch.tensor([s])).logits[0].float().numpy() for s in seqs]


def hf_logits_in(path: str, seqs: list[list[int]], dtype: str) -> list[np.ndarray]:
    """transformers' logits of each sequence in "float32" or "bfloat16" (eager attention), as float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    with torch.no_grad():
        return [model.eval()(torch.tensor([s])).logits[0].float().numpy() for s in seqs]


def fp8_case(name: str):
    """A tiny model of harness.models for the FP8 gates: (path, LoadedModel, 4 random sequences of 96 / 61 / 80 / 33
    tokens, unit KV scales [layers, planes])."""
    from engine.loader import load_model
    from harness.models import random_sequences, tiny_model_path

    path = tiny_model_path(name)
    model = load_model(path)
    layout = model.model.kv_layout()
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=1)
    return path, model, seqs, np.ones((layout.layers, layout.planes), np.float32)
