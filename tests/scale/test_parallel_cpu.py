"""Tensor parallelism on the CPU: N simulated ranks (numpy shards on threads, in-process collectives)
score the same tokens as one executor, within float32 rounding, through every KV path.

Bound: argmax equal everywhere and max |Δlogprob| <= 1e-4 over the full vocabulary of every position
(float32 against float32: the ranks only sum the same products in another order). Measured (-s prints
each case and path): max 5.5e-5 on qwen2 and 4.6e-5 on qwen3_tied (tied lm_heads, whose N(0, 1) embedding
makes logits in the tens), at most 1.1e-5 on the untied models, Qwen3-MoE's expert split included.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from engine.parallel.launch import start_cpu_ranks
from engine.request import SamplingParams
from harness.models import build_tiny_model, compare_logits, engine_logits, test_prompts, tiny_model_path

MAX_DLOGPROB = 1e-4
PATHS = {   # name -> engine_logits arguments
    "prefill": {},
    "prefill_then_decode": dict(prefill=[5, 9, 3, 12], chunks=1),
    "chunked_prefill": dict(chunks=5, seed=3),
    "batched_mixed": dict(prefill=[None, 3, 7, 16], chunks=[1, 1, 5, 9]),
}
# (model, ranks): GQA 2 split and replicated (4 ranks over 2 KV heads), MHA, GQA 4 + yarn, llama3 rope,
# qkv bias, o_proj bias (rank 0 adds it), tied lm_head, and the experts of Qwen3-MoE split 3 + 3
CASES = [("qwen3_tied", 2), ("qwen3_tied", 4), ("qwen3_untied", 2), ("qwen3_gqa4", 2), ("llama", 2),
         ("qwen2", 2), ("llama_o_bias", 2), ("qwen3_moe", 2)]


def model_path(name: str) -> str:
    if name == "llama_o_bias":
        out = os.path.join(os.path.dirname(tiny_model_path("llama")), "llama_o_bias")
        return out if os.path.isdir(out) else build_tiny_model("llama", out, attention_bias=True)
    return tiny_model_path(name)


def options(n: int = 1):
    return options_of(num_kv_blocks=48, max_model_len=512, tensor_parallel_size=n)


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-tp{n}" for m, n in CASES])
def case(request):
    name, n = request.param
    model = load_model(model_path(name))
    parallel = start_cpu_ranks(model, options(n))
    yield f"{name}-tp{n}", model, CpuExecutor(model, options()), parallel
    parallel.close()


def dlogprob(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, float]:
    results = [compare_logits(g, w) for g, w in zip(got, want)]
    return min(r.argmax_agreement for r in results), max(r.max_abs_dlogprob for r in results)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_ranks_score_as_one_executor(case, path):
    name, model, single, parallel = case
    prompts = test_prompts(model.tokenizer)
    kw = PATHS[path]
    agree, worst = dlogprob(engine_logits(parallel, prompts, **kw), engine_logits(single, prompts, **kw))
    print(f"\n{name} {path}: argmax {agree:.3f}, max |dlogprob| {worst:.2e}")
    assert agree == 1.0 and worst <= MAX_DLOGPROB


def test_sampling_and_prompt_logprobs_through_the_ranks(case):
    """execute(): rank 0 samples greedy and seeded rows and scores prompt logprobs while the other ranks
    run the same logits (their stubs); the results equal one executor's."""
    _, model, single, parallel = case
    prompts = test_prompts(model.tokenizer)
    params = [SamplingParams(temperature=0.0, prompt_logprobs=2), SamplingParams(temperature=0.8, seed=7, logprobs=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5, seed=1)]

    def run(ex):
        steps, start = [], 0
        for i, (p, sp) in enumerate(zip(prompts, params)):
            n = -(-len(p) // 16)
            steps.append(SeqStep(seq_id=i, token_ids=p, start_pos=0, block_table=list(range(start, start + n)),
                                 sample=True, params=sp, want_prompt_logprobs=sp.prompt_logprobs is not None,
                                 prompt_len=len(p), history=list(p)))
            start += n
        return ex.execute(ModelBatch.build(steps))

    got, want = run(parallel), run(single)
    assert [t.token_id for t in got.sampled] == [t.token_id for t in want.sampled]
    assert np.allclose([t.logprob or 0 for t in got.sampled], [t.logprob or 0 for t in want.sampled], atol=MAX_DLOGPROB)
    assert np.allclose(got.prompt_logprobs[0].logprobs, want.prompt_logprobs[0].logprobs, atol=MAX_DLOGPROB)


def test_the_check_fails_without_the_all_reduce():
    """The comparison can fail: ranks that skip the row-parallel sum score clearly differently."""
    model = load_model(tiny_model_path("qwen3_untied"))
    prompts = test_prompts(model.tokenizer, 2)
    parallel = start_cpu_ranks(model, options(2))
    try:
        for ex in [parallel.local] + parallel.followers.executors:
            ops = ex.ops
            ops.add_linear = lambda x, w, residual, bias=None, lora=None, ops=ops: ops.linear(x, w, bias) + residual
        agree, worst = dlogprob(engine_logits(parallel, prompts), engine_logits(CpuExecutor(model, options()), prompts))
    finally:
        parallel.close()
    assert worst > 100 * MAX_DLOGPROB


def test_a_failing_rank_fails_the_step_and_the_ranks_go_on():
    """A rank that raises inside a step: rank 0 raises (no rank waits forever in a collective) and the
    next step runs on every rank."""
    model = load_model(tiny_model_path("qwen3_untied"))
    prompts = test_prompts(model.tokenizer, 2)
    parallel = start_cpu_ranks(model, options(2))
    follower = parallel.followers.executors[0]
    real = follower.ops.attention
    try:
        follower.ops.attention = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("rank 1 broke"))
        with pytest.raises(RuntimeError, match="rank 1 broke|BrokenBarrier"):
            engine_logits(parallel, prompts)
        follower.ops.attention = real
        agree, worst = dlogprob(engine_logits(parallel, prompts), engine_logits(CpuExecutor(model, options()), prompts))
        assert agree == 1.0 and worst <= MAX_DLOGPROB
        with pytest.raises(ValueError, match="beyond max_model_len"):      # refused by every rank alike
            parallel.forward_logits(ModelBatch.build([SeqStep(0, [1], 600, list(range(38)), False)]))
        single = CpuExecutor(model, options())
        assert dlogprob(engine_logits(parallel, prompts[:1]), engine_logits(single, prompts[:1]))[0] == 1.0
    finally:
        parallel.close()
