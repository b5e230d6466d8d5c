"""Golden-logit gate: the numpy executor vs Hugging Face transformers (float32, eager) on tiny
random-weight Qwen3 / Llama / Qwen2 folders, teacher-forced, through every KV path.

Bound: argmax agreement 100% and max |Δlogprob| <= 1e-3 over the full vocabulary of every
position (measured: max 6.5e-5, p99 <= 2.7e-5 on these models; float32 vs float32, so there is no
bf16 noise floor to respect here).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from harness.models import TINY_MODELS, compare_logits, engine_logits, hf_logits, test_prompts, tiny_model_path

MAX_DLOGPROB = 1e-3


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def case(request):
    path = tiny_model_path(request.param)
    model = load_model(path)
    prompts = test_prompts(model.tokenizer)
    oracle = [hf_logits(path, p) for p in prompts]
    return model, prompts, oracle


def new_executor(model) -> CpuExecutor:
    return CpuExecutor(model, options_of(num_kv_blocks=48, max_model_len=512))


def gate_failures(engine: list[np.ndarray], oracle: list[np.ndarray]) -> list[str]:
    failures = []
    for i, (e, o) in enumerate(zip(engine, oracle)):
        failures += [f"prompt {i}: {f}" for f in compare_logits(e, o).failures(MAX_DLOGPROB)]
    return failures


def test_batch1_full_prefill_deterministic(case):
    model, prompts, oracle = case
    ex = new_executor(model)
    for p, o in zip(prompts, oracle):
        first = engine_logits(ex, [p])[0]
        again = engine_logits(ex, [p])[0]
        assert np.array_equal(first, again), "batch-1 logits differ between two identical runs"
        assert not gate_failures([first], [o])


def test_batch1_prefill_then_decode(case):
    model, prompts, oracle = case
    ex = new_executor(model)
    engine = [engine_logits(ex, [p], prefill=max(1, len(p) // 3), chunks=1)[0] for p in prompts]
    assert not gate_failures(engine, oracle)


def test_batched_mixed_lengths_one_step(case):
    model, prompts, oracle = case
    assert len({len(p) for p in prompts}) > 1
    assert not gate_failures(engine_logits(new_executor(model), prompts), oracle)


def test_batched_mixed_prefill_decode_and_chunks(case):
    """Each step mixes decodes and prefill chunks of different sizes across sequences."""
    model, prompts, oracle = case
    engine = engine_logits(new_executor(model), prompts, prefill=[None, 3, 7, 16], chunks=[1, 1, 5, 9])
    assert not gate_failures(engine, oracle)


def test_chunked_prefill(case):
    model, prompts, oracle = case
    engine = engine_logits(new_executor(model), prompts, chunks=5, seed=3)
    assert not gate_failures(engine, oracle)


def test_gate_fails_when_q_norm_is_dropped():
    """The gate is able to fail: a Qwen3 forward that skips q_norm is reported."""
    path = tiny_model_path("qwen3_tied")
    model = load_model(path)
    prompts = test_prompts(model.tokenizer, 2)
    oracle = [hf_logits(path, p) for p in prompts]
    ex = new_executor(model)
    assert not gate_failures(engine_logits(ex, prompts), oracle)   # correct forward passes
    real = ex.ops.qkv_rope_cache
    ex.ops.qkv_rope_cache = lambda qkv, spec, ctx, q_norm=None, k_norm=None: real(qkv, spec, ctx, None, k_norm)
    failures = gate_failures(engine_logits(ex, prompts), oracle)
    assert failures and any("dlogprob" in f for f in failures), failures


def test_gate_fails_on_wrong_rope_scaling():
    """Dropping the llama3 rope scaling is caught too."""
    path = tiny_model_path("llama")
    model = load_model(path)
    prompts = test_prompts(model.tokenizer, 2)
    oracle = [hf_logits(path, p) for p in prompts]
    model.config.rope_scaling = None
    assert gate_failures(engine_logits(new_executor(model), prompts), oracle)


def test_prompt_logprobs_and_sampling_match_oracle(case):
    """execute(): prompt logprobs of token_ids[1:] and the greedy pick of the last position."""
    from engine.batch import ModelBatch, SeqStep
    from engine.request import SamplingParams
    from harness.models import log_softmax
    model, prompts, oracle = case
    ex = new_executor(model)
    steps, start = [], 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // 16)
        steps.append(SeqStep(seq_id=i, token_ids=p, start_pos=0, block_table=list(range(start, start + n)),
                             sample=True, params=SamplingParams(temperature=0.0, prompt_logprobs=2),
                             want_prompt_logprobs=True, state_slot=i))
        start += n
    out = ex.execute(ModelBatch.build(steps))
    for i, (p, o) in enumerate(zip(prompts, oracle)):
        lp = log_softmax(o)
        assert out.sampled[i].token_id == int(np.argmax(o[-1]))
        got = out.prompt_logprobs[i]
        want = lp[np.arange(len(p) - 1), p[1:]]
        assert got.seq_id == i and got.start_pos == 0 and len(got.logprobs) == len(p) - 1
        assert np.max(np.abs(np.asarray(got.logprobs) - want)) <= MAX_DLOGPROB
        assert [t for t, _ in got.top_logprobs[0]] == list(np.argsort(-lp[0])[:2])
        assert_prompt_ranks(got, p, lp, MAX_DLOGPROB)


def assert_prompt_ranks(got, prompt: list[int], lp: np.ndarray | None, tol: float) -> None:
    """Each prompt token's rank (vLLM's: how many tokens are at least as likely): the top-k entries at least as
    likely where it is one of them (more only where a tie runs past k), past k where not, and (with the
    oracle's logprobs lp) within the band that logprobs off by tol allow."""
    assert len(got.ranks) == len(got.logprobs) == len(prompt) - 1
    for pos, (rank, token, x) in enumerate(zip(got.ranks, prompt[1:], got.logprobs)):
        top = got.top_logprobs[pos]
        at_least = sum(l >= x for _, l in top)
        if token in [t for t, _ in top]:
            assert rank == at_least or (rank > at_least and top[-1][1] >= x)
        else:
            assert rank > len(top)
        if lp is not None:
            assert np.count_nonzero(lp[pos] > x + tol) + 1 <= rank <= np.count_nonzero(lp[pos] >= x - tol)


def test_config_has_the_shapes_the_issue_asks_for():
    from engine.model_config import ModelConfig
    from engine.models.registry import build_model
    cfgs = {n: ModelConfig.from_file(tiny_model_path(n)) for n in TINY_MODELS}
    qwen3 = [c for c in cfgs.values() if c.model_type == "qwen3"]
    assert {c.num_attention_heads // c.num_key_value_heads for c in qwen3} == {1, 2, 4}
    assert {c.tie_word_embeddings for c in qwen3} == {True, False}
    assert any(c.head_dim != c.hidden_size // c.num_attention_heads for c in qwen3)
    assert build_model(cfgs["qwen2"]).opt.qkv_bias and cfgs["llama"].rope_scaling["rope_type"] == "llama3"


def test_executor_rejects_bad_steps_clearly():
    model = load_model(tiny_model_path("qwen2"))
    ex = CpuExecutor(model, options_of(num_kv_blocks=4, max_model_len=32))
    from engine.batch import ModelBatch, SeqStep
    with pytest.raises(ValueError, match="max_model_len"):
        ex.forward_logits(ModelBatch.build([SeqStep(0, [1, 2], 31, [0, 1, 2], False)]))
    with pytest.raises(ValueError, match="KV pool"):
        ex.forward_logits(ModelBatch.build([SeqStep(0, [1, 2], 0, [9], False)]))
    with pytest.raises(ValueError, match="token id"):
        ex.forward_logits(ModelBatch.build([SeqStep(0, [model.config.vocab_size], 0, [0], False)]))
    assert ex.forward_logits(ModelBatch.build([SeqStep(0, [1, 2], 0, [0], False)])).shape[0] == 2


def test_norm_fused_into_the_residual_add_changes_nothing(case):
    """The decoder's add_linear_norm: where an executor computes each RMSNorm with the residual add
    before it (the GPU's split-K reduction kernel), the next layer's projections, the MLP and the
    final norm take that norm and compute none of their own. Numpy ops that do so give the same
    logits, bit for bit, as the plain composition, and no norm runs twice (each of the 2L + 1 norms
    of a forward once: 2L of them inside the fused adds)."""
    from engine.executor.cpu_ops import NumpyOps

    model, prompts, _ = case

    class CountingOps(NumpyOps):
        fuse = False

        def __init__(self, *args):
            super().__init__(*args)
            self.norms = self.fused = 0

        def rms_norm(self, x, weight, eps, residual=None):
            self.norms += 1
            return super().rms_norm(x, weight, eps, residual)

        def add_linear_norm(self, x, weight, residual, norm_weight, eps, bias=None, lora=None):
            r = self.add_linear(x, weight, residual, bias, lora=lora)
            if not self.fuse:
                return r, None
            self.fused += 1
            return r, self.rms_norm(r, norm_weight, eps)[0]

    runs = {}
    for fuse in (False, True):
        ex = new_executor(model)
        ex.ops = CountingOps(ex.kv)
        ex.ops.fuse = fuse
        runs[fuse] = (engine_logits(ex, prompts[:2], prefill=3, chunks=2), ex.ops.norms, ex.ops.fused)
    (plain, plain_norms, _), (fused, fused_norms, fused_adds) = runs[False], runs[True]
    for a, b in zip(plain, fused):
        np.testing.assert_array_equal(a, b)
    layers = model.config.num_hidden_layers
    assert fused_adds > 0 and fused_adds % (2 * layers) == 0
    assert plain_norms == fused_norms      # every norm still runs once, 2L of them inside the fused adds
    assert plain_norms == fused_adds // (2 * layers) * (2 * layers + 1)
