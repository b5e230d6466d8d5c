"""Golden-logit gate of the DeepSeek-V3 / Kimi-K2 line: the numpy executor vs transformers (float32, eager)
on the tiny random-weight folders of harness DSV3_MODELS (a random score correction bias), teacher-forced,
through test_golden's paths (one prefill twice, prefill then decode, one batched step of mixed lengths,
mixed prefill / decode / chunks, chunked prefill, prompt logprobs + greedy pick); then checks that the
gate catches each piece of the router done wrong, and the line's config rules.

Bound as test_golden: argmax agreement 100%, max |Δlogprob| <= 1e-3 over the full vocabulary of every
position. Measured max |Δlogprob| (prefill / decode / chunks of 5): deepseek_v3 2.0e-5 / 2.0e-5 / 1.6e-5,
kimi_k2 3.1e-5 / 5.0e-5 / 2.9e-5; argmax agreement 100% on every path.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from engine.executor.cpu_moe_ops import route_topk
from engine.loader import load_model
from engine.models.ops import RouteSpec
from harness.models import DSV3_MODELS, engine_logits, hf_logits, test_prompts, tiny_model_path
from test_golden_moe import gate_with, golden_case
from test_golden import (gate_failures, new_executor, test_batch1_full_prefill_deterministic,  # noqa: F401
                         test_batch1_prefill_then_decode, test_batched_mixed_lengths_one_step,
                         test_batched_mixed_prefill_decode_and_chunks, test_chunked_prefill,
                         test_prompt_logprobs_and_sampling_match_oracle)


@pytest.fixture(scope="module", params=sorted(DSV3_MODELS))
def case(request):
    return golden_case(request.param)


def with_fields(**fields):
    def change(model):
        model.model.mla = dataclasses.replace(model.model.mla, **fields)
    return change


@pytest.mark.parametrize("name", sorted(DSV3_MODELS))
def test_gate_fails_without_the_score_correction_bias(name):
    def unbiased(model):
        for k in [k for k in model.weights if k.endswith("router_bias")]:
            model.weights[k] = np.zeros_like(model.weights[k])

    assert gate_with(name, unbiased)


def test_gate_fails_with_softmax_scores():
    assert gate_with("kimi_k2", with_fields(scoring_func="softmax"))


def test_gate_fails_without_group_limited_routing():
    assert gate_with("deepseek_v3", with_fields(n_group=1, topk_group=1))


def test_gate_fails_without_the_routed_scaling_factor_or_renormalization():
    assert gate_with("kimi_k2", with_fields(routed_scaling_factor=1.0))
    assert gate_with("deepseek_v3", with_fields(norm_topk_prob=False))


def test_weights_come_from_the_unbiased_scores_and_groups_from_top2_sums():
    """The router by hand on a case where each rule matters: the bias moves the choice but not the
    weights, and a group whose single best expert is highest loses to one with a better top-2 sum."""
    spec = RouteSpec(num_experts=6, top_k=2, renormalize=False, scale=2.0, num_groups=3, topk_groups=1,
                     scoring="sigmoid")
    scores = np.array([[0.9, 0.1, 0.7, 0.6, 0.2, 0.3]], np.float32)       # group 0 best single, group 1 best sum
    logits = np.log(scores / (1 - scores))
    weights, ids = route_topk(logits, spec, bias=np.zeros(6, np.float32))
    assert ids.tolist() == [[2, 3]]
    np.testing.assert_allclose(weights, [[1.4, 1.2]], rtol=1e-6)
    bias = np.array([0, 0, 0, 0, 0.5, 0.5], np.float32)                       # group 2's sum: 1.5 > 1.3
    weights, ids = route_topk(logits, spec, bias=bias)
    assert ids.tolist() == [[5, 4]]
    np.testing.assert_allclose(weights, [[0.6, 0.4]], rtol=1e-6)


def test_config_rules():
    from engine.models.deepseek_v3 import DeepseekV3Config

    base = dict(model_type="deepseek_v3", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, n_group=4,
                topk_group=2, first_k_dense_replace=1)
    cfg = DeepseekV3Config.from_raw(base)
    assert cfg.route.scoring == "sigmoid" and cfg.route.renormalize and cfg.group_limited
    assert [cfg.sparse(i) for i in range(3)] == [False, True, True]
    for bad, needle in ((dict(topk_method="greedy"), "topk_method"), (dict(scoring_func="softmax"), "scoring_func"),
                        (dict(moe_layer_freq=2), "moe_layer_freq"), (dict(rope_interleave=False), "rope_interleave"),
                        (dict(n_group=8, topk_group=2), "2 or more experts"),
                        (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "group")):
        with pytest.raises(ValueError, match=needle):
            DeepseekV3Config.from_raw({**base, **bad})


def test_multi_token_prediction_layers_are_left_unread(tmp_path, caplog):
    """A checkpoint with an MTP layer past num_hidden_layers (as DeepSeek-V3 ships layer 61) loads with a
    log line, and its logits are those of the folder without it."""
    import json
    import shutil

    from engine.loader.safetensors_io import SafetensorsCheckpoint, save_safetensors

    src = tiny_model_path("deepseek_v3")
    shutil.copytree(src, tmp_path / "m")
    ckpt = SafetensorsCheckpoint(str(tmp_path / "m"))
    tensors = {k: np.array(ckpt.get(k)) for k in ckpt.keys()}
    L = 3
    tensors.update({k.replace("model.layers.2.", f"model.layers.{L}."): v for k, v in list(tensors.items())
                    if k.startswith("model.layers.2.")})
    tensors[f"model.layers.{L}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    del ckpt
    save_safetensors(str(tmp_path / "m" / "model.safetensors"), tensors)
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with caplog.at_level(logging.INFO, logger="engine.models.deepseek_v3"):
        model = load_model(str(tmp_path / "m"))
    assert "1 multi-token-prediction layer(s)" in caplog.text
    prompts = test_prompts(model.tokenizer, 2)
    assert not gate_failures(engine_logits(new_executor(model), prompts), [hf_logits(src, p) for p in prompts])
