"""Golden-logit gate of the DeepSeek-V4 line on the numpy executor: the tiny random model of harness
DSV4_MODELS (one sliding, one compressed-sparse and one heavily-compressed layer, a hash-routed MLP first,
3 hyper-connection streams) vs transformers float32, teacher-forced, through test_golden's paths (one prefill
twice, prefill then decode, one batched step of mixed lengths, mixed prefill / decode / chunks, chunked
prefill, prompt logprobs + greedy pick; transformers held to the engine's order among equal indexer scores,
harness/dsv4_oracle.py); then the gate is shown to catch each mechanism left out, and the line
through EngineHandle on the CPU (its GPU ops: tests/kernels/test_dsv4_gpu_emulated.py, tests/gpu/test_gpu_dsv4.py).

Bound as test_golden: argmax agreement 100%, max |Δlogprob| <= 1e-3. Measured max |Δlogprob| (prefill /
decode / chunks of 5): 8.6e-6 / 9.5e-6 / 1.0e-5; argmax agreement 100%.
"""
from __future__ import annotations

import dataclasses

import pytest

from harness.dsv4_oracle import index_tie_rule
from harness.models import DSV4_MODELS, tiny_model_path
from test_golden import (test_batch1_full_prefill_deterministic,  # noqa: F401
                         test_batch1_prefill_then_decode, test_batched_mixed_lengths_one_step,
                         test_batched_mixed_prefill_decode_and_chunks, test_chunked_prefill,
                         test_prompt_logprobs_and_sampling_match_oracle)
from test_golden_moe import gate_with, golden_case
from test_handle_moe import GREEDY, hf_greedy_check


@pytest.fixture(scope="module", params=sorted(DSV4_MODELS))
def case(request):
    with index_tie_rule():          # transformers' choice among equal indexer scores is unspecified: the engine's
        return golden_case(request.param)


def with_specs(layer: int, **fields):
    def change(model):
        specs = model.model.attention_specs
        specs[layer] = dataclasses.replace(specs[layer], **fields)
    return change


def with_v4(**fields):
    def change(model):
        model.model.v4 = dataclasses.replace(model.model.v4, **fields)
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
    assert gate_with("deepseek_v4", change), what


def test_gate_catches_the_compress_rope_on_the_compressed_layers():
    def main_rope(model):
        specs = model.model.attention_specs
        for i in (1, 2):
            specs[i] = dataclasses.replace(specs[i], inv_freq=specs[0].inv_freq)
    assert gate_with("deepseek_v4", main_rope)


def test_serves_the_oracle_greedy_tokens_on_the_cpu():
    from engine.config import EngineConfig
    from engine.handle import EngineHandle

    path = tiny_model_path("deepseek_v4")
    prompt = [(13 * i + 5) % 3000 + 10 for i in range(37)]
    with EngineHandle(EngineConfig(model=path, device="cpu", max_model_len=128, num_kv_blocks=32)) as h:
        out, = h.generate([prompt], GREEDY)
    assert out.error is None and len(out.outputs[0].token_ids) == 8
    with index_tie_rule():
        hf_greedy_check(path, prompt, out.outputs[0].token_ids)



def test_decode_rows_attended_together_equal_each_alone(case, monkeypatch):
    """A step's one-query sequences attend as one group padded to its longest context (attention_groups); with
    a group budget of one row each sequence attends alone, and the logits are the same (the padding is
    invisible); the grouped steps pass the gate."""
    import numpy as np

    import engine.executor.cpu_dsv4_attention as attention
    from test_golden import gate_failures, new_executor
    from harness.models import engine_logits

    model, prompts, oracle = case
    assert attention.attention_groups(np.array([1, 1, 3, 1]), np.array([9, 40, 13, 6]), 80) == [[3, 0], [1], [2]]
    grouped = engine_logits(new_executor(model), prompts, prefill=[7, 3, 12, 5], chunks=1)
    monkeypatch.setattr(attention, "CONTEXT_ROWS_PER_GROUP", 1)
    alone = engine_logits(new_executor(model), prompts, prefill=[7, 3, 12, 5], chunks=1)
    for g, a in zip(grouped, alone):
        np.testing.assert_allclose(g, a, atol=1e-4)
    assert not gate_failures(grouped, oracle)


def test_a_prompts_queries_attended_in_chunks_equal_them_at_once(case, monkeypatch):
    """A prompt's queries attend in chunks of chunk_queries (QUERY_KEY_PAIRS bounds a chunk's scores, whatever the
    prompt's length): with a budget of a few pairs every chunk is a handful of queries, each reading only the
    entries closed up to its last query (later chunks' are not stored yet), and the logits are those of one chunk
    a prompt; both pass the gate."""
    import numpy as np

    import engine.executor.cpu_dsv4_attention as attention
    from test_golden import gate_failures, new_executor
    from harness.models import engine_logits

    model, prompts, oracle = case
    spec = next(s for s in model.model.attention_specs if s.index_heads)
    assert attention.chunk_queries(4096, spec, 1 << 40) > 4096 and attention.chunk_queries(4096, spec, 1) == 1
    q = attention.chunk_queries(100, spec, 5000)
    assert q * (q + spec.window - 1 + 100 // spec.rate) <= 5000 < (q + 1) * (q + spec.window + 100 // spec.rate)
    whole = engine_logits(new_executor(model), prompts, prefill=[40, 33, 52, 45], chunks=1)
    monkeypatch.setattr(attention, "QUERY_KEY_PAIRS", 7 * (7 + spec.window))
    chunked = attention.attention_chunks(np.array([40, 1]), np.array([40, 9]), spec)
    step = attention.chunk_queries(40, spec, attention.QUERY_KEY_PAIRS)
    assert 1 < step < 8 and chunked[0] == ([1], 0, 1)
    assert [c[1:] for c in chunked[1:]] == [(q0, min(step, 40 - q0)) for q0 in range(0, 40, step)]
    starts = []
    split = attention.attention_chunks
    monkeypatch.setattr(attention, "attention_chunks", lambda *a: [starts.append(c[1]) or c for c in split(*a)])
    pieces = engine_logits(new_executor(model), prompts, prefill=[40, 33, 52, 45], chunks=1)
    assert max(starts) >= 24                    # a chunk past several closed windows of its prompt
    for w, c in zip(whole, pieces):
        np.testing.assert_allclose(w, c, atol=1e-4)
    assert not gate_failures(pieces, oracle)


def test_chunks_longer_than_the_rings(case):
    """Prefill chunks of twice the longest compressor ring (ring_len tokens) after a first step of ring_len - 1
    tokens (on the tiny model both rates' windows end one token short there: the most a ring must carry into the
    next step): a window closing in a chunk reads its earlier inputs from the step's own rows, not the ring (which
    keeps only the step's last ring_len), and the open windows' first inputs from the ring."""
    from test_golden import gate_failures, new_executor
    from harness.models import engine_logits

    model, prompts, oracle = case
    ring = max(s.ring_len for s in model.model.attention_specs)
    assert all(ring % s.rate == 0 for s in model.model.attention_specs if s.rate)
    assert max(len(p) for p in prompts) >= ring - 1 + 2 * ring                       # a whole long chunk
    engine = engine_logits(new_executor(model), prompts, prefill=ring - 1, chunks=2 * ring, seed=1)
    assert not gate_failures(engine, oracle)
