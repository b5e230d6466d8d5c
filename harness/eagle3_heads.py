"""Tiny random EAGLE-3 draft heads in the public checkpoint layout (EAGLE-3 / SpecForge's LlamaForCausalLMEagle3,
as vLLM's llama_eagle3.py loads it), for a given target folder: config.json and model.safetensors (bf16 weights;
d2t int64 offsets, t2d bool). The shapes are written from the layout here, not from the engine's loader, so the
loader is checked against them.

    from harness.eagle3_heads import write_random_eagle3
    head = write_random_eagle3(tiny_model_path("qwen3_tied"), out_dir, aux_layers=[0, 1, 1])
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from engine.loader.safetensors_io import save_safetensors


def _shapes(H: int, Ht: int, I: int, heads: int, kv_heads: int, D: int, V: int, Vd: int) -> dict[str, tuple]:
    """The layout: fc over three target hidden states, one Llama layer whose q/k/v read [embedding, hidden]
    (2 H wide), the final norm and an lm_head over the draft vocabulary."""
    m = "midlayer."
    return {"fc.weight": (H, 3 * Ht), f"{m}input_layernorm.weight": (H,), f"{m}hidden_norm.weight": (H,),
            f"{m}self_attn.q_proj.weight": (heads * D, 2 * H), f"{m}self_attn.k_proj.weight": (kv_heads * D, 2 * H),
            f"{m}self_attn.v_proj.weight": (kv_heads * D, 2 * H), f"{m}self_attn.o_proj.weight": (H, heads * D),
            f"{m}post_attention_layernorm.weight": (H,), f"{m}mlp.gate_proj.weight": (I, H),
            f"{m}mlp.up_proj.weight": (I, H), f"{m}mlp.down_proj.weight": (H, I), "norm.weight": (H,),
            "lm_head.weight": (Vd, H), "embed_tokens.weight": (V, H)}


def write_random_eagle3(target_dir: str, out_dir: str, seed: int = 0, hidden: int | None = None, heads: int = 4,
                        kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96, draft_vocab: int | None = None,
                        aux_layers: list[int] | None = None, ship_embed: bool = False, norm_before_residual=False,
                        prefix: str = "", rope: dict | None = None, speculators: bool = False) -> str:
    """A random head for the target in target_dir: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.2); draft_vocab:
    a random sorted subset of the target's ids (d2t, t2d) where smaller than its vocabulary; aux_layers: written
    as eagle_config.eagle_aux_hidden_state_layer_ids (None: left out, the engine's default); ship_embed: its own
    embed_tokens (else the target's is used); prefix: put before every tensor name ("model."); speculators: the
    config in vLLM speculators' form (Eagle3Speculator, the layer's fields under transformer_layer_config)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    V, Ht = target["vocab_size"], target["hidden_size"]
    H, Vd = hidden or Ht, draft_vocab or V
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in _shapes(H, Ht, intermediate, heads, kv_heads, head_dim, V, Vd).items():
        if name == "embed_tokens.weight" and not ship_embed:
            continue
        a = (1 + 0.2 * rng.standard_normal(shape) if len(shape) == 1 else
             rng.standard_normal(shape) * (1.0 if "embed" in name else 1.5 / shape[-1] ** 0.5))
        tensors[prefix + name] = a.astype(ml_dtypes.bfloat16)
    if Vd < V:
        kept = np.sort(rng.choice(V, Vd, replace=False))
        tensors["d2t"] = (kept - np.arange(Vd)).astype(np.int64)
        tensors["t2d"] = np.isin(np.arange(V), kept)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": Vd,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "norm_before_residual": norm_before_residual, "target_hidden_size": Ht, **(rope or {})}
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}
    if speculators:
        top = ("draft_vocab_size", "target_hidden_size", "norm_before_residual")
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  **{k: config[k] for k in top}, "transformer_layer_config": {
                      k: v for k, v in config.items() if k not in top + ("architectures", "eagle_config")}}
        if aux_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    os.makedirs(out_dir, exist_ok=True)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir
