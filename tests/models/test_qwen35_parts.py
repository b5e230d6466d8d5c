"""The Qwen3.5 line's parts without the oracle: the chunk-parallel delta rule equals the token-by-token
recurrence, the conv carries its window across steps, the config (both forms, the real 4B shape) and
the KV / state declarations, and the state slot allocator."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine.executor.cpu_deltanet_ops import chunked_gated_delta_rule, recurrent_gated_delta_rule
from engine.model_config import ModelConfig
from engine.models.qwen3_5 import Qwen3_5ForCausalLM, rotary_permutation
from engine.models.registry import build_model
from engine.models.rope import rope_inv_freq
from memory.state_slots import StateSlots

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_4B = os.path.join(REPO, "bench", "configs", "qwen3.5-4b", "config.json")


def delta_inputs(n: int, H: int = 3, Dk: int = 16, Dv: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)   # noqa: E731
    q = unit(rng.standard_normal((n, H, Dk))).astype(np.float32) * np.float32(Dk ** -0.5)
    k = unit(rng.standard_normal((n, H, Dk))).astype(np.float32)
    v = rng.standard_normal((n, H, Dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.7, (n, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (n, H)).astype(np.float32)
    state = rng.standard_normal((H, Dk, Dv)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n,chunk", [(1, 64), (7, 4), (64, 64), (150, 64), (33, 16)])
def test_chunked_delta_rule_equals_recurrence(n, chunk):
    q, k, v, g, beta, state = delta_inputs(n, seed=n)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o, s = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=2e-5)


def test_chunked_delta_rule_carries_state_across_calls():
    """Two calls (a step boundary) give what one call gives; a dropped state would not."""
    q, k, v, g, beta, state = delta_inputs(40, seed=1)
    o_all, s_all = chunked_gated_delta_rule(q, k, v, g, beta, state, 16)
    o1, s1 = chunked_gated_delta_rule(q[:23], k[:23], v[:23], g[:23], beta[:23], state, 16)
    o2, s2 = chunked_gated_delta_rule(q[23:], k[23:], v[23:], g[23:], beta[23:], s1, 16)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o_all, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(s2, s_all, rtol=1e-4, atol=2e-5)
    o_lost, _ = chunked_gated_delta_rule(q[23:], k[23:], v[23:], g[23:], beta[23:], np.zeros_like(s1), 16)
    assert np.abs(o_lost - o_all[23:]).max() > 1e-2


def test_rotary_permutation_puts_checkpoint_pairs_at_half_distance():
    D, rot = 16, 8
    perm = rotary_permutation(D, rot)
    assert sorted(perm.tolist()) == list(range(D))
    for i in range(rot // 2):                      # checkpoint pair (i, i + rot/2) -> engine (i, i + D/2)
        assert (perm[i], perm[i + D // 2]) == (i, i + rot // 2)


def real_4b_config() -> dict:
    with open(CONFIG_4B, encoding="utf-8") as f:
        return json.load(f)


def test_real_4b_config_and_declarations():
    cfg = ModelConfig.from_dict(real_4b_config())
    model = build_model(cfg)
    assert isinstance(model, Qwen3_5ForCausalLM)
    assert (len(model.linear_specs), len(model.attention_specs)) == (24, 8)
    assert [s.layer for s in model.attention_specs] == list(range(8))        # KV pool indices
    assert model.kv_layout().layers == 8 and model.kv_layout().dim == 256
    state = model.state_layout()
    assert state.slot_bytes(2) == 24 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)  # 49.1 MiB per sequence on the GPU
    spec = model.linear_specs[0]
    assert (spec.conv_dim, spec.proj_size) == (8192, 8192 + 4096 + 64)
    inv_freq, factor = rope_inv_freq(cfg)
    assert inv_freq.shape == (128,) and factor == 1.0
    assert np.all(inv_freq[32:] == 0) and np.all(inv_freq[:32] > 0)       # 64 of 256 dims rotate
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e7


def test_composite_config_takes_the_text_config_and_its_tie():
    d = real_4b_config()
    text = {k: v for k, v in d.items() if k not in ("architectures",)}
    composite = {"model_type": "qwen3_5", "text_config": {**text, "tie_word_embeddings": False},
                 "tie_word_embeddings": True, "vision_config": {}}
    cfg = ModelConfig.from_dict(composite)
    assert cfg.model_type == "qwen3_5" and cfg.hidden_size == 2560 and cfg.tie_word_embeddings
    assert type(build_model(cfg)).prefix == "model.language_model."
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"model_type": "qwen3_5"})


def test_state_slots_allocate_lowest_first_and_refuse_double_free():
    slots = StateSlots(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(1)
    slots.free(0)
    assert slots.allocate() == 0 and slots.num_free == 1
    with pytest.raises(ValueError):
        slots.free(1)
