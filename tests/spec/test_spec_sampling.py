"""Draft verification's sampling, statistically: with drafts verified by the CPU executor (engine/sampling.py
verify_seq) at temperature 0.7 with top_p 0.9 and top_k, the tokens emitted at the draft positions follow the
target's distribution — the first emitted token the target's distribution after the prompt, the second (when the
first draft was accepted) the target's after the prompt and that draft — by a chi-square goodness-of-fit test at
significance 0.001 over 3,000 seeds, the target distribution taken from transformers' float32 logits on the same
weights; the first draft is accepted with probability p(draft). And the verify step's contract: which rows are
sampled, greedy acceptance, logprobs per emitted token."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.request import SamplingParams
from engine.sampling import filtered_probs, log_softmax, processed_logits
from harness.models import TINY_MODELS, _tmp_root, build_config_model, hf_logits

VOCAB = 256                    # a small vocabulary: the filtered distribution has few tokens, each well sampled
SAMPLES = 3000
ALPHA = 1e-3                   # the chi-square tests' significance
PARAMS = dict(temperature=0.7, top_p=0.9, top_k=40)


@functools.lru_cache(maxsize=1)
def model_path() -> str:
    cls, overrides = TINY_MODELS["qwen3_untied"]
    return build_config_model(cls, overrides, os.path.join(_tmp_root(), "qwen3_untied_vocab256"), seed=3, vocab=VOCAB)


@functools.lru_cache(maxsize=1)
def executor():
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    return CpuExecutor(load_model(model_path()), options_of(num_kv_blocks=SAMPLES + 8, max_model_len=64,
                                                            max_num_seqs=SAMPLES, max_num_batched_tokens=1 << 16))


def target(prefix: list[int]) -> np.ndarray:
    """The target's sampling distribution after prefix: transformers' float32 logits, then temperature, top_k
    and top_p as engine/sampling.py defines them."""
    logits = hf_logits(model_path(), prefix)[-1].astype(np.float32)
    p = SamplingParams(**PARAMS)
    return filtered_probs(processed_logits(logits, p, prefix, len(prefix), 0), p)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's goodness-of-fit p-value, tokens with an expected count under 5 pooled into one bin; 0 where a
    token the distribution cannot give was seen."""
    import torch
    if counts[probs == 0].any():
        return 0.0
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def verify_batch(prompt: list[int], drafts: list[int], seeds: range, **params):
    """One executor step: every seed's sequence feeds prompt + drafts (its own KV block), drafts verified."""
    steps = [SeqStep(seq_id=i, token_ids=prompt + drafts, start_pos=0, block_table=[i], sample=True,
                     params=SamplingParams(seed=seed, **params), prompt_len=len(prompt), history=list(prompt),
                     num_drafts=len(drafts)) for i, seed in enumerate(seeds)]
    return executor().execute(ModelBatch.build(steps)).sampled


def test_emitted_tokens_follow_the_target_distribution():
    prompt = [50, 97, 60, 101, 154, 143, 93, 51]
    p0 = target(prompt)                           # 29 tokens kept, the likeliest 0.25
    d1 = int(np.argmax(p0))                       # accepted often, rejected often
    p1 = target(prompt + [d1])
    d2 = int(np.argmax(p1))
    sampled = verify_batch(prompt, [d1, d2], range(SAMPLES), **PARAMS)
    first = np.array([t.emitted()[0].token_id for t in sampled])
    accepted = first == d1
    assert accepted.sum() == sum(len(t.accepted) > 0 for t in sampled)
    # the first draft is accepted with probability p0(d1): a binomial count within 4 standard deviations
    assert abs(accepted.sum() - SAMPLES * p0[d1]) < 4 * np.sqrt(SAMPLES * p0[d1] * (1 - p0[d1]))
    assert chi_square_p(np.bincount(first, minlength=VOCAB), p0) > ALPHA
    second = np.array([t.emitted()[1].token_id for t, a in zip(sampled, accepted) if a])
    assert len(second) > 500
    assert chi_square_p(np.bincount(second, minlength=VOCAB), p1) > ALPHA
    # the test has power: the same counts are far from the distribution before the draft
    assert chi_square_p(np.bincount(second, minlength=VOCAB), p0) < ALPHA


def test_a_verify_step_samples_its_draft_rows():
    """sample_rows: the last 1 + num_drafts rows of each verify step (a plain row of a step without drafts)."""
    steps = [SeqStep(seq_id=0, token_ids=[5, 6, 7, 8], start_pos=3, block_table=[0], sample=True, num_drafts=2),
             SeqStep(seq_id=1, token_ids=[1, 2, 3], start_pos=0, block_table=[1], sample=False),
             SeqStep(seq_id=2, token_ids=[9], start_pos=4, block_table=[2], sample=True),
             SeqStep(seq_id=3, token_ids=[4, 4], start_pos=0, block_table=[3], sample=True, num_drafts=1)]
    assert ModelBatch.build(steps).sample_rows.tolist() == [1, 2, 3, 7, 8, 9]
    for bad in (SeqStep(seq_id=4, token_ids=[4, 4], start_pos=0, block_table=[3], sample=True, num_drafts=2),
                SeqStep(seq_id=4, token_ids=[4, 4], start_pos=0, block_table=[3], sample=False, num_drafts=1)):
        with pytest.raises(ValueError, match="draft tokens"):
            ModelBatch.build([bad])


def test_greedy_verification_accepts_the_argmax_prefix_with_each_tokens_logprobs():
    prompt = [3, 141, 59, 26]
    greedy, rows = [], []
    for _ in range(4):                         # the target's own greedy continuation, from transformers
        logits = hf_logits(model_path(), prompt + greedy)[-1]
        rows.append(log_softmax(logits))
        greedy.append(int(np.argmax(logits)))
    wrong = (greedy[2] + 1) % VOCAB
    (token,) = verify_batch(prompt, greedy[:2] + [wrong], range(1), temperature=0.0, logprobs=1)
    assert [t.token_id for t in token.emitted()] == greedy[:3]        # 2 accepted, the third corrected
    for t, row, g in zip(token.emitted(), rows, greedy):
        assert abs(t.logprob - row[g]) < 2e-5 and t.top_logprobs[0][0] == g
    (token,) = verify_batch(prompt, greedy[:3], range(1), temperature=0.0)
    assert [t.token_id for t in token.emitted()] == greedy[:4]        # all accepted, and the bonus token
