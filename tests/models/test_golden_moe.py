"""Golden-logit gate of the MoE and MLA lines: the numpy executor vs transformers (float32, eager) on the
tiny random-weight Qwen3-MoE and DeepSeek-V2 folders of harness SPARSE_MODELS, teacher-forced. The
path tests of test_golden (one prefill twice, prefill then decode, one batched step of mixed lengths,
mixed prefill / decode / chunks, chunked prefill, prompt logprobs + greedy pick) run here on these
models, then checks that the gate catches each piece of the lines done wrong.

Bound as test_golden: argmax agreement 100%, max |Δlogprob| <= 1e-3 over the full vocabulary of every
position. Measured max |Δlogprob| per model (prefill / decode / chunks of 5 / mixed): qwen3_moe
9.5e-6 / 8.6e-6 / 1.1e-5 / 8.6e-6, deepseek_v2_lite 2.2e-5 / 2.2e-5 / 2.1e-5 / 2.6e-5, deepseek_v2
1.7e-5 / 1.7e-5 / 1.4e-5 / 1.8e-5; argmax agreement 100% on every path.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.executor.cpu_mla_ops import mla_absorbed, mla_expanded
from engine.loader import load_model
from harness.models import SPARSE_MODELS, engine_logits, hf_logits, test_prompts, tiny_model_path
from test_golden import (gate_failures, new_executor, test_batch1_full_prefill_deterministic,  # noqa: F401
                         test_batch1_prefill_then_decode, test_batched_mixed_lengths_one_step,
                         test_batched_mixed_prefill_decode_and_chunks, test_chunked_prefill,
                         test_prompt_logprobs_and_sampling_match_oracle)


def golden_case(name: str):
    """(model, prompts, oracle logits) of tiny model `name`: what test_golden's path tests take as `case`."""
    path = tiny_model_path(name)
    model = load_model(path)
    prompts = test_prompts(model.tokenizer)
    return model, prompts, [hf_logits(path, p) for p in prompts]


@pytest.fixture(scope="module", params=sorted(SPARSE_MODELS))
def case(request):
    return golden_case(request.param)


def gate_with(name: str, change) -> list[str]:
    """The gate's failures on model `name` after change(model) (which may patch what it needs)."""
    path = tiny_model_path(name)
    model = load_model(path)
    prompts = test_prompts(model.tokenizer, 2)
    oracle = [hf_logits(path, p) for p in prompts]
    assert not gate_failures(engine_logits(new_executor(model), prompts, prefill=3, chunks=4), oracle)
    change(model)
    return gate_failures(engine_logits(new_executor(model), prompts, prefill=3, chunks=4), oracle)


def test_gate_fails_on_neox_rope_for_mla(monkeypatch):
    """DeepSeek's rope pairs (x[2i], x[2i+1]); rotating (x[i], x[i + D/2]) instead is caught."""
    import engine.executor.cpu_mla_ops as mla
    from engine.executor.cpu_ops import rope as _rope

    assert gate_with("deepseek_v2_lite", lambda m: monkeypatch.setattr(mla, "rope_interleaved", _rope))


def test_gate_fails_without_the_yarn_mscale_on_the_softmax_scale():
    def plain_scale(model):
        mla = model.model
        mla.attention_specs = [dataclasses.replace(s, scale=mla.mla.qk_head_dim ** -0.5) for s in mla.attention_specs]

    assert gate_with("deepseek_v2_lite", plain_scale)


def test_gate_fails_without_group_limited_routing():
    def greedy(model):
        model.model.mla = dataclasses.replace(model.model.mla, n_group=1, topk_group=1)

    assert gate_with("deepseek_v2", greedy)


def test_gate_fails_without_the_routed_scaling_factor():
    def unscaled(model):
        model.model.mla = dataclasses.replace(model.model.mla, routed_scaling_factor=1.0)

    assert gate_with("deepseek_v2_lite", unscaled)


def test_gate_fails_without_norm_topk_prob():
    def raw_weights(model):
        model.model.moe = dataclasses.replace(model.model.moe, norm_topk_prob=False)

    assert gate_with("qwen3_moe", raw_weights)


def test_absorbed_and_expanded_mla_agree():
    """The decode form (W_UK folded into q, W_UV after attention over the latent) equals the expanded
    form on random data, causal mask included."""
    rng = np.random.default_rng(0)
    n, L, H, N, Dr, V, R = 3, 11, 4, 24, 8, 20, 32
    f = lambda *s: rng.standard_normal(s).astype(np.float32)          # noqa: E731
    args = (f(n, H, N), f(n, H, Dr), f(L, R), f(L, Dr), f(H, N, R) / 4, f(H, V, R) / 4)
    masked = np.arange(L)[None, :] > np.array([7, 8, 10])[:, None]
    a, b = mla_absorbed(*args, masked, 0.2), mla_expanded(*args, masked, 0.2)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not np.allclose(a[0], mla_absorbed(*args, np.zeros_like(masked), 0.2)[0], atol=1e-3)


def test_the_paged_cache_holds_the_latent_and_rope_key_of_transformers():
    """After a prefill, every layer's cache row of a token is transformers' own cache entry for it:
    the RMSNorm'd latent, then the rotated rope key (576 values per layer on V2-Lite, not K and V)."""
    import torch

    from engine.batch import ModelBatch, SeqStep
    from harness.models import hf_model

    path = tiny_model_path("deepseek_v2_lite")
    model = load_model(path)
    ex = new_executor(model)
    m = model.model.mla
    assert ex.kv.shape[1] == 1 and ex.kv.shape[3] == 1 and ex.kv.shape[4] == m.kv_lora_rank + m.qk_rope_head_dim
    ids = test_prompts(model.tokenizer, 2)[1]
    ex.forward_logits(ModelBatch.build([SeqStep(0, ids, 0, [5, 2, 7], False)]))
    slots = np.array([[5, 2, 7][p // 16] * 16 + p % 16 for p in range(len(ids))])
    with torch.no_grad():
        cache = hf_model(path)(torch.tensor([ids]), use_cache=True).past_key_values
    for layer in range(model.config.num_hidden_layers):
        latent, k_pe = (t[0, 0].numpy() for t in (cache.layers[layer].keys, cache.layers[layer].values))
        np.testing.assert_allclose(ex.kv[layer, 0, slots, 0], np.concatenate([latent, k_pe], -1), atol=2e-5)


def test_layer_kinds_follow_transformers():
    """Which layers route to experts: Qwen3-MoE's decoder_sparse_step / mlp_only_layers and DeepSeek's
    first_k_dense_replace, against the module transformers builds for each layer."""
    import torch
    import transformers

    from engine.model_config import ModelConfig
    from engine.models.registry import build_model

    cases = [("Qwen3MoeConfig", dict(num_experts=5, decoder_sparse_step=2, mlp_only_layers=[3])),
             ("Qwen3MoeConfig", dict(num_experts=5, decoder_sparse_step=1, mlp_only_layers=[0, 4])),
             ("DeepseekV2Config", dict(n_routed_experts=5, first_k_dense_replace=2, n_group=1, topk_group=1))]
    for cls, extra in cases:
        hf_cfg = getattr(transformers, cls)(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                            num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                            num_experts_per_tok=2, moe_intermediate_size=16, **extra)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        ours = build_model(ModelConfig.from_dict(hf_cfg.to_dict()))
        lines = ours.moe if hasattr(ours, "moe") else ours.mla
        want = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
        assert [lines.sparse(i) for i in range(6)] == want, cls
        assert any(want) and not all(want)


def test_stacked_expert_weights_pack_per_expert_tensors():
    from engine.models.weights import check_weights, pack_weights, stacked

    parts = {f"e{e}.{p}": np.full((2, 3), 10 * e + i, np.float32) for e in range(3) for i, p in enumerate("gu")}
    spec = stacked("gate_up", [[(f"e{e}.g", (2, 3)), (f"e{e}.u", (2, 3))] for e in range(3)])
    w = pack_weights([spec], parts.__contains__, parts.__getitem__)
    assert spec.shape == w["gate_up"].shape == (3, 4, 3)
    assert [w["gate_up"][e, :, 0].tolist() for e in range(3)] == [[0, 0, 1, 1], [10, 10, 11, 11], [20, 20, 21, 21]]
    check_weights([spec], w)
    with pytest.raises(KeyError, match="e1.u"):
        pack_weights([spec], lambda n: n != "e1.u", parts.__getitem__)
    # a later expert (written by the loader's thread pool) with a wrong shape or a wider dtype is named
    with pytest.raises(ValueError, match="e2.g"):
        pack_weights([spec], parts.__contains__, {**parts, "e2.g": np.zeros((3, 3), np.float32)}.__getitem__)
    with pytest.raises(ValueError, match="e1.u"):
        pack_weights([spec], parts.__contains__, {**parts, "e1.u": np.zeros((2, 3), np.float64)}.__getitem__)


def test_unsupported_deepseek_settings_are_refused():
    from engine.models.deepseek_v2 import DeepseekV2Config

    base = dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=8)
    for bad, needle in ((dict(topk_method="noaux_tc"), "topk_method"), (dict(scoring_func="sigmoid"), "scoring_func"),
                        (dict(norm_topk_prob=True), "norm_topk_prob"),
                        (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1), "group")):
        with pytest.raises(ValueError, match=needle):
            DeepseekV2Config.from_raw({**base, **bad})
