"""Golden-logit gate of the Qwen3.5 hybrid line (Gated DeltaNet + gated attention): the numpy executor vs
Hugging Face transformers float32 (its torch fallbacks of the conv and the chunked delta rule), on tiny
random-weight models in both checkpoint forms (harness/hybrid_models.py: odd head counts, key dim !=
value dim, a full-attention layer not at the end, partial rotary), teacher-forced, through every path
that carries state: one prefill, prefill then decode, chunked prefill with the chunk boundary inside the
conv window, several delta-rule chunks in one step (a 150-token sequence: 64 + 64 + 22), and batched
sequences of different lengths mixing all of them.

Bound: argmax 100% and max |Δlogprob| <= 1e-3 over the full vocabulary of every position (measured
2026-12: max 3.7e-4, p99 <= 7.3e-5, mean <= 1.1e-5 over every path; the max is on qwen3_5_text's
150-token sequence, where HF float32 itself is 1.4e-4 from HF float64 and we are 2.1e-4 from it).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from harness.hybrid_models import HYBRID_MODELS, hybrid_hf_logits, hybrid_model_path
from harness.models import compare_logits, engine_logits, random_sequences, test_prompts

MAX_DLOGPROB = 1e-3
LONG = 150                      # tokens: two full delta-rule chunks of 64 and a partial one


@pytest.fixture(scope="module", params=sorted(HYBRID_MODELS))
def case(request):
    path = hybrid_model_path(request.param)
    model = load_model(path)
    prompts = test_prompts(model.tokenizer) + random_sequences(model.config.vocab_size, [LONG], seed=5)
    oracle = [hybrid_hf_logits(path, p) for p in prompts]
    return model, prompts, oracle


def new_executor(model) -> CpuExecutor:
    return CpuExecutor(model, options_of(num_kv_blocks=64, max_model_len=512, max_num_seqs=8))


def gate_failures(engine: list[np.ndarray], oracle: list[np.ndarray]) -> list[str]:
    failures = []
    for i, (e, o) in enumerate(zip(engine, oracle)):
        failures += [f"prompt {i}: {f}" for f in compare_logits(e, o).failures(MAX_DLOGPROB)]
    return failures


def test_prefill_batched_and_deterministic(case):
    """Every sequence in one step (the 150-token one in three delta-rule chunks); batch 1 twice is
    bit-identical."""
    model, prompts, oracle = case
    ex = new_executor(model)
    assert not gate_failures(engine_logits(ex, prompts), oracle)
    first, again = engine_logits(ex, [prompts[1]])[0], engine_logits(ex, [prompts[1]])[0]
    assert np.array_equal(first, again), "batch-1 logits differ between two identical runs"


def test_prefill_then_decode(case):
    model, prompts, oracle = case
    ex = new_executor(model)
    engine = [engine_logits(ex, [p], prefill=max(1, len(p) // 3), chunks=1)[0] for p in prompts[:3]]
    assert not gate_failures(engine, oracle[:3])


@pytest.mark.parametrize("chunk", [2, 5, 65])
def test_chunked_prefill(case, chunk):
    """Chunks of 2 (every chunk boundary inside the conv window: the window spans three steps), 5, and
    65 (a step boundary one token past a delta-rule chunk)."""
    model, prompts, oracle = case
    engine = engine_logits(new_executor(model), prompts, chunks=chunk, seed=3)
    assert not gate_failures(engine, oracle)


def test_batched_mixed_prefill_decode_and_chunks(case):
    """Each step mixes decodes (batched one-step recurrence) and prefill chunks of different sizes."""
    model, prompts, oracle = case
    engine = engine_logits(new_executor(model), prompts, prefill=[None, 3, 7, 16, 70], chunks=[1, 1, 2, 9, 33])
    assert not gate_failures(engine, oracle)


def test_gate_fails_when_state_is_not_carried():
    """The gate is able to fail: a forward that starts every step from zero state (recurrent, or only
    the conv window) is caught by chunked prefill and by decode."""
    path = hybrid_model_path("qwen3_5_text")
    model = load_model(path)
    prompts = test_prompts(model.tokenizer, 2)
    oracle = [hybrid_hf_logits(path, p) for p in prompts]
    ex = new_executor(model)
    assert not gate_failures(engine_logits(ex, prompts, chunks=2), oracle)
    deltanet = ex.ops.deltanet
    for name in ("recurrent", "conv"):
        real = deltanet.state[name]
        deltanet.state = {**deltanet.state, name: _Forgetful(real)}
        assert gate_failures(engine_logits(ex, prompts, chunks=2), oracle), f"{name} state loss not caught"
        assert gate_failures(engine_logits(ex, prompts, prefill=4, chunks=1), oracle)
        deltanet.state = {**deltanet.state, name: real}


class _Forgetful:
    """A state array whose reads give zeros (writes are dropped): every step starts fresh."""

    def __init__(self, real: np.ndarray):
        self.real = real

    def __getitem__(self, layer):
        return _Zeros(self.real[layer])


class _Zeros:
    def __init__(self, layer: np.ndarray):
        self.shape, self.dtype = layer.shape, layer.dtype

    def __getitem__(self, idx):
        return np.zeros(np.zeros(self.shape, self.dtype)[idx].shape, self.dtype)

    def __setitem__(self, idx, value):
        pass


def test_prompt_logprobs_across_chunks_match_oracle(case):
    """A chunk that ends inside the prompt scores the next prompt token too (its logprob needs the
    chunk's last row: a stateful line cannot re-feed that token), so chunked prompt logprobs are whole."""
    from engine.batch import ModelBatch, SeqStep
    from engine.request import SamplingParams
    from harness.models import log_softmax
    model, prompts, oracle = case
    ex = new_executor(model)
    p, lp = prompts[1], log_softmax(oracle[1])
    got: dict[int, float] = {}
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    for start in range(0, len(p), 6):
        toks = p[start:start + 6]
        step = SeqStep(seq_id=0, token_ids=toks, start_pos=start, block_table=[0, 1, 2], sample=False, params=params,
                       prompt_len=len(p), history=p, want_prompt_logprobs=True, state_slot=0)
        res = ex.execute(ModelBatch.build([step])).prompt_logprobs[0]
        got.update({res.start_pos + 1 + i: v for i, v in enumerate(res.logprobs)})
    assert sorted(got) == list(range(1, len(p)))
    want = lp[np.arange(len(p) - 1), p[1:]]
    assert np.max(np.abs(np.array([got[i] for i in range(1, len(p))]) - want)) <= MAX_DLOGPROB
