"""Models of the free-running gate (tests/models/test_free_running.py): every line's tiny model with a small vocabulary
(GATE_VOCAB rows: the gate runs thousands of steps on each side, and the vocabulary's rows dominate a tiny
model's step), seeded random tiny configurations per line for the sweeps, and the transformers oracle of a
folder on any device.

    path = gate_model_path("deepseek_v2")                  # harness/models.py's config, 4096 rows
    line, path = sweep_model("deepseek_v2", seed=3)        # a random MLA / routing shape of the line
"""
from __future__ import annotations

import functools
import json
import os
import random

from harness.hybrid_models import HYBRID_MODELS, build_hybrid_config
from harness.models import DSV3_MODELS, SPARSE_MODELS, TINY_MODELS, _tmp_root, build_config_model

GATE_VOCAB = 4096
CONFIGS = {**TINY_MODELS, **SPARSE_MODELS, **DSV3_MODELS}
LINES = sorted(CONFIGS) + sorted(HYBRID_MODELS)


def build(spec: tuple, out_dir: str, seed: int = 0) -> str:
    """An HF folder of ("hybrid", composite, text overrides) or (transformers config class, overrides)."""
    if spec[0] == "hybrid":
        return build_hybrid_config(spec[1], spec[2], out_dir, seed, vocab=GATE_VOCAB)
    return build_config_model(spec[0], spec[1], out_dir, seed, vocab=GATE_VOCAB)


@functools.lru_cache(maxsize=None)
def gate_model_path(name: str) -> str:
    """Model `name` of harness/models.py or harness/hybrid_models.py with GATE_VOCAB rows, built once per process."""
    spec = ("hybrid", *HYBRID_MODELS[name]) if name in HYBRID_MODELS else CONFIGS[name]
    return build(spec, os.path.join(_tmp_root(), f"{name}-v{GATE_VOCAB}"))


def load_oracle(path: str, dtype: str = "float32", device: str = "cpu"):
    """transformers' model of the folder (eager attention): the composite Qwen3.5 form as image-text-to-text
    (its lm_head ties as the composite config says), the rest as causal LMs."""
    import torch
    import transformers
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        composite = json.load(f).get("model_type") == "qwen3_5"
    auto = transformers.AutoModelForImageTextToText if composite else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    return model.to(device).eval()


def hf_autocast(model):
    """The context transformers' model runs in: DeepSeek-V4 in bf16 under bf16 autocast (its float32
    hyper-connection streams reach bf16 projections uncast in transformers 5.x: a dtype error, not a different
    model); every other model as loaded."""
    import contextlib

    import torch
    if model.config.model_type == "deepseek_v4" and model.dtype == torch.bfloat16:
        return torch.autocast(model.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---- seeded random configurations -------------------------------------------------------------------------------
def _heads(rng: random.Random, choices=(2, 3, 4, 8)) -> dict:
    heads = rng.choice(choices)
    return dict(num_attention_heads=heads, num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]))


def _yarn(original: int) -> dict:
    """yarn from `original` positions to the tiny models' 512 (transformers warns where the factor says otherwise)."""
    return {"rope_type": "yarn", "factor": 512 / original, "original_max_position_embeddings": original}


def _rope(rng: random.Random, kinds: tuple[str, ...]) -> dict:
    kind = rng.choice(kinds)
    theta = rng.choice([10000.0, 500000.0])
    if kind == "default":
        return dict(rope_theta=theta)
    scaling = {"linear": {"rope_type": "linear", "factor": 2.0},
               "yarn": _yarn(rng.choice([16, 64, 128])),
               "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": rng.choice([32, 64])}}[kind]
    return dict(rope_theta=theta, rope_scaling=scaling)


def dense_config(rng: random.Random, line: str) -> tuple:
    """qwen3 / llama / qwen2: heads and GQA, head_dim, tying, rope scaling (qkv bias on llama as an option)."""
    common = dict(tie_word_embeddings=rng.random() < 0.5, num_hidden_layers=rng.choice([1, 2, 3]))
    if line == "qwen3":
        return "Qwen3Config", dict(common, **_heads(rng), head_dim=rng.choice([8, 16, 32]),
                                   **_rope(rng, ("default", "linear", "yarn")))
    common.update(_heads(rng, (2, 4, 8)))            # head_dim = hidden / heads
    if line == "llama":
        return "LlamaConfig", dict(common, attention_bias=rng.random() < 0.3,
                                   **_rope(rng, ("default", "linear", "llama3", "yarn")))
    return "Qwen2Config", dict(common, **_rope(rng, ("default", "yarn")))


def qwen3_moe_config(rng: random.Random) -> tuple:
    """Experts (not a power of two as often as not), top-k, renormalised or not, dense layers mixed in."""
    layers, experts = rng.choice([2, 3]), rng.choice([3, 4, 6, 8])
    return "Qwen3MoeConfig", dict(
        **_heads(rng), head_dim=rng.choice([16, 32]), num_hidden_layers=layers, num_experts=experts,
        num_experts_per_tok=rng.randint(1, min(3, experts)), moe_intermediate_size=rng.choice([16, 24, 40]),
        norm_topk_prob=rng.random() < 0.5, decoder_sparse_step=rng.choice([1, 2]),
        mlp_only_layers=rng.sample(range(layers), rng.randint(0, 1)), tie_word_embeddings=rng.random() < 0.5,
        rope_theta=rng.choice([10000.0, 1000000.0]))


def _mla(rng: random.Random) -> dict:
    """MLA shapes: q LoRA or a plain q_proj, latent rank, rope dim != nope dim != v dim (some equal)."""
    heads = rng.choice([2, 4])
    return dict(num_hidden_layers=rng.choice([2, 3]), num_attention_heads=heads, num_key_value_heads=heads,
                q_lora_rank=rng.choice([None, 24, 48]), kv_lora_rank=rng.choice([16, 32]),
                qk_nope_head_dim=rng.choice([8, 16, 24]), qk_rope_head_dim=rng.choice([4, 8, 16]),
                v_head_dim=rng.choice([8, 16, 20]), first_k_dense_replace=rng.choice([0, 1]),
                n_shared_experts=rng.choice([1, 2]), moe_intermediate_size=rng.choice([16, 24]),
                routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]), tie_word_embeddings=False)


def _mla_yarn(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return dict(rope_theta=10000.0)
    return dict(rope_theta=10000.0, rope_scaling={**_yarn(rng.choice([16, 128])), "beta_fast": 32, "beta_slow": 1,
                                                  "mscale": 1.0, "mscale_all_dim": rng.choice([0.8, 1.0])})


def _groups(rng: random.Random, experts: int, min_per_group: int) -> tuple[int, int, int]:
    """(n_group, topk_group, top_k) that group-limited routing can hold."""
    n_group = rng.choice([g for g in (1, 2, 3, 4) if experts % g == 0 and experts // g >= min_per_group])
    topk_group = rng.randint(1, n_group)
    return n_group, topk_group, rng.randint(1, min(3, topk_group * (experts // n_group)))


def deepseek_v2_config(rng: random.Random) -> tuple:
    """DeepSeek-V2: softmax routing, greedy or group-limited top-k."""
    experts = rng.choice([4, 6, 8])
    n_group, topk_group, top_k = _groups(rng, experts, 1)
    method = "group_limited_greedy" if n_group > 1 else "greedy"
    return "DeepseekV2Config", dict(**_mla(rng), **_mla_yarn(rng), n_routed_experts=experts, num_experts_per_tok=top_k,
                                    topk_method=method, n_group=n_group, topk_group=topk_group)


def deepseek_v3_config(rng: random.Random) -> tuple:
    """DeepSeek-V3 / Kimi-K2: sigmoid scores with the correction bias, groups by top-2 sums, renormalised or not."""
    experts = rng.choice([4, 6, 8])
    n_group, topk_group, top_k = _groups(rng, experts, 2)
    return "DeepseekV3Config", dict(**_mla(rng), **_mla_yarn(rng), n_routed_experts=experts, num_experts_per_tok=top_k,
                                    n_group=n_group, topk_group=topk_group, norm_topk_prob=rng.random() < 0.7,
                                    num_nextn_predict_layers=0)


def qwen3_5_config(rng: random.Random) -> tuple:
    """Qwen3.5: layer kinds in any order (one of each at least), conv window 2-4, linear heads and dims, partial
    rotary, either checkpoint form."""
    layers = rng.choice([2, 3, 4])
    kinds = ["full_attention"] + ["linear_attention"] * (layers - 1)
    rng.shuffle(kinds)
    k_heads = rng.choice([1, 2])
    heads = rng.choice([2, 3, 5])
    text = dict(num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
                num_key_value_heads=rng.choice([d for d in (1, heads) if heads % d == 0]),
                head_dim=rng.choice([16, 32]), linear_num_key_heads=k_heads,
                linear_num_value_heads=k_heads * rng.choice([1, 2, 3]), linear_key_head_dim=rng.choice([8, 16]),
                linear_value_head_dim=rng.choice([8, 16]), linear_conv_kernel_dim=rng.choice([2, 3, 4]),
                tie_word_embeddings=rng.random() < 0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0])})
    return "hybrid", rng.random() < 0.5, text


SWEEP_LINES = {"qwen3": lambda r: dense_config(r, "qwen3"), "llama": lambda r: dense_config(r, "llama"),
               "qwen2": lambda r: dense_config(r, "qwen2"), "qwen3_moe": qwen3_moe_config,
               "deepseek_v2": deepseek_v2_config, "deepseek_v3": deepseek_v3_config, "qwen3_5": qwen3_5_config}


def sweep_spec(line: str, seed: int) -> tuple:
    """The seeded random configuration of `line` (a key of SWEEP_LINES)."""
    return SWEEP_LINES[line](random.Random(f"{line}/{seed}"))


@functools.lru_cache(maxsize=None)
def sweep_model(line: str, seed: int) -> str:
    """The folder of sweep_spec(line, seed), built once per process (weights seeded too)."""
    return build(sweep_spec(line, seed), os.path.join(_tmp_root(), f"sweep-{line}-{seed}"), seed)
