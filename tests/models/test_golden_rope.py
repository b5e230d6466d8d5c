"""Rotary tables (engine/models/rope.py) vs transformers' rope init functions, per scaling type."""
from __future__ import annotations

import numpy as np
import pytest

from engine.model_config import ModelConfig
from engine.models.rope import rope_cos_sin, rope_inv_freq

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2},
}


def hf_config(scaling: dict, theta: float):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=theta,
                       max_position_embeddings=131072, rope_scaling=dict(scaling))


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inv_freq_matches_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theta = 500000.0
    hf = hf_config(SCALINGS[name], theta)
    want, want_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](hf, "cpu")
    cfg = ModelConfig.from_dict(hf.to_dict())
    got, factor = rope_inv_freq(cfg)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-6)
    assert factor == pytest.approx(want_factor, rel=1e-6)


def test_default_rope_and_tables():
    cfg = ModelConfig.from_dict(dict(model_type="qwen3", hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, head_dim=32, intermediate_size=8,
                                     vocab_size=10, rope_theta=10000.0))
    inv, factor = rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, 1.0 / 10000.0 ** (np.arange(0, 32, 2) / 32), rtol=1e-6)
    cos, sin = rope_cos_sin(cfg, 100)
    assert cos.shape == (100, 16) and factor == 1.0
    np.testing.assert_allclose(cos[7], np.cos(7 * inv), atol=1e-6)
    np.testing.assert_allclose(sin[7], np.sin(7 * inv), atol=1e-6)
    cfg.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(cfg)
