"""The sharding rules (engine/parallel/sharding.py): every declared weight of a supported line has one,
a rank's shards have the shapes its own model line declares, the ranks' shards put back together are
the whole weights (packed qkv / gate_up split part by part, GQA KV heads replicated over the ranks that
share them), and what cannot be split is refused at start."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from engine.loader import load_model
from engine.models.registry import MODEL_REGISTRY, build_model
from engine.parallel.sharding import (COLS, EXPERTS, RANK0, REPLICATE, ROWS, SUPPORTED_TYPES, Shard,
                                      check_tensor_parallel, shard_config, shard_model, split_of)
from harness.models import SPARSE_MODELS, TINY_MODELS, tiny_model_path, tiny_model_type


@pytest.fixture(scope="module", params=[name for name in {**TINY_MODELS, **SPARSE_MODELS}
                                        if tiny_model_type(name) in SUPPORTED_TYPES])
def loaded(request):
    """Each tiny model of a line declaring tensor-parallel sharding."""
    return load_model(tiny_model_path(request.param))


def shards(loaded, n):
    return [shard_model(loaded, Shard(r, n)) for r in range(n)]


def test_rank_weights_have_the_shapes_their_line_declares(loaded):
    full = {s.name: s for s in loaded.model.weight_specs()}
    for rank in shards(loaded, 2):
        declared = {s.name: s.shape for s in rank.model.weight_specs()}
        for name, w in rank.weights.items():
            kind = split_of(name, loaded.config).kind
            if name == "lm_head":
                assert w.shape == (loaded.config.vocab_size // 2, loaded.config.hidden_size)
            elif kind == EXPERTS:
                assert w.shape == (full[name].shape[0] // 2, *full[name].shape[1:])
            else:
                assert tuple(w.shape) == declared[name], name
        assert rank.model.kv_layout().heads * 2 == max(loaded.config.num_key_value_heads, 2)


@pytest.mark.parametrize("n", [2, 4])
def test_shards_put_back_together_are_the_whole_weights(n):
    """qwen3_tied: 4 query heads, 2 KV heads (4 ranks: each KV head on two ranks), head_dim 32."""
    loaded = load_model(tiny_model_path("qwen3_tied"))
    cfg, D = loaded.config, loaded.config.head_dim
    ranks = shards(loaded, n)
    whole = {name: np.asarray(w, np.float32) for name, w in loaded.weights.items()}
    q, kv = cfg.q_size, cfg.kv_size
    qkv = [np.asarray(r.weights["layers.1.qkv_proj"], np.float32) for r in ranks]
    local_q = q // n
    assert np.array_equal(np.concatenate([w[:local_q] for w in qkv]), whole["layers.1.qkv_proj"][:q])
    for r, w in enumerate(qkv):            # rank r's K / V head: r · kv_heads // n
        head = r * cfg.num_key_value_heads // n
        k = whole["layers.1.qkv_proj"][q + head * D:q + (head + 1) * D]
        v = whole["layers.1.qkv_proj"][q + kv + head * D:q + kv + (head + 1) * D]
        assert np.array_equal(w[local_q:local_q + D], k) and np.array_equal(w[local_q + D:], v)
    o = np.concatenate([np.asarray(r.weights["layers.0.o_proj"], np.float32) for r in ranks], axis=1)
    assert np.array_equal(o, whole["layers.0.o_proj"])
    gate_up = [np.asarray(r.weights["layers.0.gate_up_proj"], np.float32) for r in ranks]
    inter = cfg.intermediate_size
    assert np.array_equal(np.concatenate([g[:inter // n] for g in gate_up]), whole["layers.0.gate_up_proj"][:inter])
    assert np.array_equal(np.concatenate([g[inter // n:] for g in gate_up]), whole["layers.0.gate_up_proj"][inter:])
    down = np.concatenate([np.asarray(r.weights["layers.0.down_proj"], np.float32) for r in ranks], axis=1)
    assert np.array_equal(down, whole["layers.0.down_proj"])
    lm_head = np.concatenate([np.asarray(r.weights["lm_head"], np.float32) for r in ranks])
    assert np.array_equal(lm_head, whole["embed_tokens"])                      # tied: the embedding's rows
    for r in ranks:
        assert r.weights["embed_tokens"] is loaded.weights["embed_tokens"]      # replicated, not copied
        assert r.model.config.num_attention_heads * n == cfg.num_attention_heads


def test_split_weights_are_views_of_the_checkpoint():
    loaded = load_model(tiny_model_path("qwen3_untied"))
    rank = shard_model(loaded, Shard(1, 2))
    assert np.shares_memory(rank.weights["layers.0.o_proj"], loaded.weights["layers.0.o_proj"])
    assert np.shares_memory(rank.weights["lm_head"], loaded.weights["lm_head"])


def test_every_kind_of_rule_is_named():
    cfg = load_model(tiny_model_path("qwen3_moe")).config
    rules = {name: split_of(name, cfg).kind for name in (
        "embed_tokens", "lm_head", "norm", "layers.0.input_layernorm", "layers.0.qkv_proj", "layers.0.qkv_bias",
        "layers.0.o_proj", "layers.0.o_bias", "layers.0.q_norm", "layers.0.gate_up_proj", "layers.0.down_proj",
        "layers.1.router", "layers.1.experts_gate_up_proj", "layers.1.experts_down_proj")}
    assert rules == {"embed_tokens": REPLICATE, "lm_head": ROWS, "norm": REPLICATE,
                     "layers.0.input_layernorm": REPLICATE, "layers.0.qkv_proj": ROWS, "layers.0.qkv_bias": ROWS,
                     "layers.0.o_proj": COLS, "layers.0.o_bias": RANK0, "layers.0.q_norm": REPLICATE,
                     "layers.0.gate_up_proj": ROWS, "layers.0.down_proj": COLS, "layers.1.router": REPLICATE,
                     "layers.1.experts_gate_up_proj": EXPERTS, "layers.1.experts_down_proj": EXPERTS}
    with pytest.raises(ValueError, match="no sharding rule for weight 'layers.0.kv_a_proj'"):
        split_of("layers.0.kv_a_proj", cfg)


@pytest.mark.parametrize("name,n,changes,words", [
    ("qwen3_untied", 3, {}, "does not divide num_attention_heads"),
    ("qwen3_tied", 2, {"num_attention_heads": 6, "num_key_value_heads": 3},
     r"does not divide num_key_value_heads \(3\), nor is a multiple of it"),
    ("qwen3_untied", 2, {"intermediate_size": 97}, "does not divide intermediate_size"),
    ("qwen3_untied", 2, {"vocab_size": 1001}, "does not divide vocab_size"),
    ("qwen3_moe", 4, {}, r"does not divide the routed experts \(6\)"),
    ("deepseek_v2_lite", 2, {}, "the deepseek_v2 line has no tensor-parallel sharding"),
    ("qwen3_untied", 0, {}, "must be >= 1"),
])
def test_what_cannot_be_split_is_refused(name, n, changes, words):
    cfg = dataclasses.replace(load_model(tiny_model_path(name)).config, **changes)
    with pytest.raises(ValueError, match=f"tensor_parallel_size {n}: {words}"):
        check_tensor_parallel(build_model(cfg), n)


@pytest.mark.parametrize("model_type", sorted(set(MODEL_REGISTRY) - set(SUPPORTED_TYPES)))
def test_every_line_without_sharding_is_refused_by_name(model_type):
    """The registered lines the rules do not cover (latent attention: DeepSeek-V2 / V3, Kimi-K2; DeepSeek-V4's
    hyper-connections and shared K = V head; the Qwen3.5 DeltaNet hybrid) are refused before any weight is
    looked at, not sharded by the dense rules."""
    model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2: the {model_type} line has no tensor-parallel"):
        check_tensor_parallel(model, 2)
    assert set(SUPPORTED_TYPES) <= set(MODEL_REGISTRY)


def test_rank_config_keeps_head_dim_and_replicates_too_few_kv_heads():
    cfg = load_model(tiny_model_path("qwen3_tied")).config          # 4 heads, 2 KV heads, head_dim 32
    four = shard_config(cfg, 4)
    assert (four.num_attention_heads, four.num_key_value_heads, four.head_dim) == (1, 1, 32)
    assert four.intermediate_size == cfg.intermediate_size // 4 and not four.tie_word_embeddings
