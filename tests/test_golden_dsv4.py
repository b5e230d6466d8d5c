"""Golden-logit gate of the DeepSeek-V4 line on the numpy executor: the tiny random model of harness
DSV4_MODELS (one sliding, one compressed-sparse and one heavily-compressed layer, a hash-routed MLP first,
3 hyper-connection streams) vs transformers float32, teacher-forced, through test_golden's paths (one prefill
twice, prefill then decode, one batched step of mixed lengths, mixed prefill / decode / chunks, chunked
prefill, prompt logprobs + greedy pick); then the gate is shown to catch each mechanism left out, and the line
through EngineHandle on the CPU (the GPU executor refuses it at start).

Bound as test_golden: argmax agreement 100%, max |Δlogprob| <= 1e-3. Measured max |Δlogprob| (prefill /
decode / chunks of 5): 1.2e-5 / 1.3e-5 / 1.0e-5; argmax agreement 100%.
"""
from __future__ import annotations

import dataclasses

import pytest

from engine.loader import load_model
from harness.models import DSV4_MODELS, engine_logits, hf_logits, test_prompts, tiny_model_path
from test_golden import (gate_failures, new_executor, test_batch1_full_prefill_deterministic,  # noqa: F401
                         test_batch1_prefill_then_decode, test_batched_mixed_lengths_one_step,
                         test_batched_mixed_prefill_decode_and_chunks, test_chunked_prefill,
                         test_prompt_logprobs_and_sampling_match_oracle)
from test_handle_moe import GREEDY, hf_greedy_check


@pytest.fixture(scope="module", params=sorted(DSV4_MODELS))
def case(request):
    path = tiny_model_path(request.param)
    model = load_model(path)
    prompts = test_prompts(model.tokenizer)
    return model, prompts, [hf_logits(path, p) for p in prompts]


def gate_with(change) -> list[str]:
    path = tiny_model_path("deepseek_v4")
    model = load_model(path)
    prompts = test_prompts(model.tokenizer)
    oracle = [hf_logits(path, p) for p in prompts]
    assert not gate_failures(engine_logits(new_executor(model), prompts, prefill=3, chunks=4), oracle)
    change(model.model)
    return gate_failures(engine_logits(new_executor(model), prompts, prefill=3, chunks=4), oracle)


def with_specs(layer: int, **fields):
    def change(line):
        line.attention_specs[layer] = dataclasses.replace(line.attention_specs[layer], **fields)
    return change


def with_v4(**fields):
    def change(line):
        line.v4 = dataclasses.replace(line.v4, **fields)
    return change


@pytest.mark.parametrize("what,change", [
    ("the indexer's top-k (every closed entry seen)", with_specs(1, index_topk=10 ** 6)),
    ("the heavily compressed entries", with_specs(2, rate=0)),
    ("the sliding window", with_specs(0, window=10 ** 6)),
    ("the Sinkhorn iterations", with_v4(hc_iters=1)),
    ("swiglu_limit", with_v4(swiglu_limit=float("inf"))),
    ("the routed scaling factor", with_v4(scale=1.0)),
])
def test_gate_catches_a_mechanism_left_out(what, change):
    assert gate_with(change), what


def test_gate_catches_the_compress_rope_on_the_compressed_layers():
    def main_rope(line):
        for i in (1, 2):
            s = line.attention_specs[i]
            line.attention_specs[i] = dataclasses.replace(s, inv_freq=line.attention_specs[0].inv_freq)
    assert gate_with(main_rope)


def test_serves_the_oracle_greedy_tokens_on_the_cpu():
    from engine.config import EngineConfig
    from engine.handle import EngineHandle

    path = tiny_model_path("deepseek_v4")
    prompt = [(13 * i + 5) % 3000 + 10 for i in range(37)]
    with EngineHandle(EngineConfig(model=path, device="cpu", max_model_len=128, num_kv_blocks=32)) as h:
        out, = h.generate([prompt], GREEDY)
    assert out.error is None and len(out.outputs[0].token_ids) == 8
    hf_greedy_check(path, prompt, out.outputs[0].token_ids)


def test_the_gpu_executor_refuses_the_line(monkeypatch):
    import engine.executor.factory as factory
    from engine.executor.options import options_of

    model = load_model(tiny_model_path("deepseek_v4"))
    monkeypatch.setattr(factory, "resolve_device", lambda device: "cuda")
    with pytest.raises(ValueError, match="--device cpu"):
        factory.create_executor(model, options_of(max_model_len=64), device="cuda")
