"""LoRA gate on the CPU: the numpy executor with PEFT adapters vs transformers + peft in float32, on tiny
random-weight Qwen3 and Llama models with three random adapters (harness/lora.py TINY_ADAPTERS: ranks 8,
4 and 16; attention only, MLP only with rsLoRA, and a partial set that leaves k and gate alone inside their
packed projections), teacher-forced.

Bound: argmax agreement 100% and max |Δlogprob| <= 1e-3 over the full vocabulary of every position, per
adapter, through a full prefill, prefill-then-decode and chunked prefill (measured: max 5.0e-5 on
qwen3_tied, 1.2e-5 on llama). A batch mixing every adapter and the base model gives each sequence the
logprobs it has alone, argmax for argmax (measured: max |Δlogprob| 4.6e-5, 1.1e-5: the BLAS's summation
order differs between batch sizes, as it does without adapters; bound 1e-4).
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.lora import load_adapter, lora_sites
from engine.loader import load_model
from harness.lora import TINY_ADAPTERS, hf_lora_logits, tiny_adapter_path
from harness.models import compare_logits, engine_logits, hf_logits, log_softmax, test_prompts, tiny_model_path

MAX_DLOGPROB = 1e-3
MIXED_VS_ALONE = 1e-4
MODELS = ["qwen3_tied", "llama"]
ADAPTERS = sorted(TINY_ADAPTERS)
PATHS = {"prefill": dict(), "decode": dict(prefill=[9, 3, 17, 1], chunks=1), "chunked": dict(chunks=[5, 16, 7, 3])}


def lora_executor(model, max_loras: int = 3) -> CpuExecutor:
    return CpuExecutor(model, options_of(num_kv_blocks=64, max_model_len=512, max_loras=max_loras, max_lora_rank=16))


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    """(model name, executor with the adapters in slots 0.., prompts, oracle per adapter, base oracle)."""
    name = request.param
    path = tiny_model_path(name)
    model = load_model(path)
    ex = lora_executor(model)
    sites = lora_sites(ex.model)
    prompts = test_prompts(model.tokenizer)
    oracle = {}
    for slot, a in enumerate(ADAPTERS):
        folder = tiny_adapter_path(name, a)
        ex.set_lora(slot, load_adapter(a, folder, sites, model.config.num_hidden_layers, 16))
        oracle[a] = [hf_lora_logits(path, folder, p) for p in prompts]
    return name, ex, prompts, oracle, [hf_logits(path, p) for p in prompts]


def failures(engine: list[np.ndarray], oracle: list[np.ndarray]) -> list[str]:
    out = []
    for i, (e, o) in enumerate(zip(engine, oracle)):
        out += [f"prompt {i}: {f}" for f in compare_logits(e, o).failures(MAX_DLOGPROB)]
    return out


@pytest.mark.parametrize("path_name", sorted(PATHS))
def test_each_adapter_matches_peft(case, path_name):
    name, ex, prompts, oracle, base = case
    for slot, a in enumerate(ADAPTERS):
        engine = engine_logits(ex, prompts, lora_slots=[slot] * len(prompts), **PATHS[path_name])
        worst = max(compare_logits(e, o).max_abs_dlogprob for e, o in zip(engine, oracle[a]))
        print(f"{name}/{a}/{path_name}: max |dlogprob| {worst:.3g}")
        assert not failures(engine, oracle[a]), (a, failures(engine, oracle[a]))
        # the adapter really changes the model: its oracle is far from the base model's
        assert max(compare_logits(b, o).max_abs_dlogprob for b, o in zip(base, oracle[a])) > 0.5


def test_mixed_batch_equals_each_alone(case):
    """Every adapter and the base model in one batch (prefill, then decode steps, chunks of several sizes):
    each sequence scores as it does alone and as the oracle says."""
    _, ex, prompts, oracle, base = case
    seqs = [prompts[i % len(prompts)] for i in range(len(ADAPTERS) + 1)]
    slots = list(range(len(ADAPTERS))) + [None]
    mixed = engine_logits(ex, seqs, prefill=[3, 7, None, 2], chunks=[1, 4, 1, 5], lora_slots=slots)
    for seq, slot, got in zip(seqs, slots, mixed):
        alone = engine_logits(ex, [seq], lora_slots=[slot])[0]
        d = np.abs(log_softmax(got) - log_softmax(alone))
        print(f"slot {slot}: mixed vs alone max |dlogprob| {d.max():.3g}")
        assert d.max() <= MIXED_VS_ALONE and np.array_equal(got.argmax(-1), alone.argmax(-1))
        want = base[prompts.index(seq)] if slot is None else oracle[ADAPTERS[slot]][prompts.index(seq)]
        assert not failures([got], [want])


def test_gate_fails_on_the_wrong_adapter_or_scaling(case):
    """The gate is able to fail: another slot's adapter, or B without its scaling, is reported."""
    name, ex, prompts, oracle, _ = case
    assert failures(engine_logits(ex, prompts[:2], lora_slots=[1, 1]), oracle[ADAPTERS[0]][:2])
    adapter = load_adapter("x", tiny_adapter_path(name, "attn8"), lora_sites(ex.model), 2, 16)
    for w in adapter.sites.values():
        w.b /= adapter.scaling
    ex.set_lora(2, adapter)
    try:
        assert failures(engine_logits(ex, prompts[:2], lora_slots=[2, 2]), oracle["attn8"][:2])
    finally:
        ex.set_lora(2, load_adapter(ADAPTERS[2], tiny_adapter_path(name, ADAPTERS[2]), lora_sites(ex.model), 2, 16))


def test_rank_and_alpha_patterns_match_peft(case, tmp_path):
    """PEFT's rank_pattern / alpha_pattern (a module name, a full path, a regex): each module its own rank
    (zero-padded to the adapter's largest) and scaling; read without the alpha pattern, the gate fails."""
    name, ex, prompts, _, _ = case
    folder = tiny_adapter_path(name, "patterned8")
    oracle = [hf_lora_logits(tiny_model_path(name), folder, p) for p in prompts[:2]]
    sites = lora_sites(ex.model)
    adapter = load_adapter("p", folder, sites, 2, 16)
    assert adapter.rank == 12 and sites["layers.0.qkv_proj"].n == adapter.sites["layers.0.qkv_proj"].b.shape[0]
    unpatterned = str(tmp_path / "unpatterned")
    shutil.copytree(folder, unpatterned)
    cfg = json.load(open(os.path.join(unpatterned, "adapter_config.json")))
    cfg["alpha_pattern"] = {}
    json.dump(cfg, open(os.path.join(unpatterned, "adapter_config.json"), "w"))
    try:
        ex.set_lora(2, adapter)
        got = engine_logits(ex, prompts[:2], lora_slots=[2, 2], chunks=[5, 16])
        print(f"{name}/patterned8: max |dlogprob| {max(compare_logits(e, o).max_abs_dlogprob for e, o in zip(got, oracle)):.3g}")
        assert not failures(got, oracle)
        ex.set_lora(2, load_adapter("u", unpatterned, sites, 2, 16))
        assert failures(engine_logits(ex, prompts[:2], lora_slots=[2, 2]), oracle)
    finally:
        ex.set_lora(2, load_adapter(ADAPTERS[2], tiny_adapter_path(name, ADAPTERS[2]), sites, 2, 16))


def test_steps_without_adapters_score_as_the_base_model(case):
    _, ex, prompts, _, base = case
    got = engine_logits(ex, prompts[:2], chunks=[4, 16])
    assert not failures(got, base[:2]) and ex.ops.lora.groups == []
