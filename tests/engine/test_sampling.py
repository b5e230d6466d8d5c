"""The host sampler against the definitions in engine/sampling.py, on crafted logits."""
import numpy as np
import pytest

from engine.batch import SeqStep
from engine.request import SamplingParams
from engine.sampling import draw, filtered_probs, processed_logits, sample_step

V = 8


def step(params, history=(), prompt_len=0, seq_id=0):
    history = list(history)
    return SeqStep(seq_id=seq_id, token_ids=[0], start_pos=0, block_table=[0], sample=True,
                   params=params, prompt_len=prompt_len, history=history,
                   num_generated=len(history) - prompt_len)


def sample(logits, params, **kw):
    return sample_step(np.asarray([logits], np.float32), [step(params, **kw)])[0]


def empirical(logits, params, n=4000):
    counts = np.zeros(len(logits))
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": i})
        counts[sample(logits, p).token_id] += 1
    return counts / n


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = [0.0, 3.0, 1.0, 3.0, -1.0, 0.0, 0.0, 0.0]
    assert sample(logits, SamplingParams(temperature=0)).token_id == 1


def test_temperature_distribution_matches_softmax():
    logits = np.array([1.0, 2.0, 0.5, -1.0, 0.0, 0.3, 1.5, -0.5])
    for t in (0.5, 1.0, 2.0):
        want = np.exp(logits / t) / np.exp(logits / t).sum()
        got = empirical(logits, SamplingParams(temperature=t))
        assert np.abs(got - want).max() < 0.03, (t, got, want)


def test_top_k_keeps_exactly_the_k_best():
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    probs = filtered_probs(logits, SamplingParams(top_k=3))
    assert set(np.nonzero(probs)[0]) == {0, 1, 2}
    want = np.exp(logits[:3]) / np.exp(logits[:3]).sum()
    np.testing.assert_allclose(probs[:3], want, rtol=1e-6)
    got = empirical(logits, SamplingParams(top_k=3), n=2000)
    assert got[3:].sum() == 0


def test_top_p_keeps_the_token_that_crosses_the_mass():
    p = np.array([0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]) + 1e-12
    logits = np.log(p)
    assert set(np.nonzero(filtered_probs(logits, SamplingParams(top_p=0.79)))[0]) == {0, 1}
    assert set(np.nonzero(filtered_probs(logits, SamplingParams(top_p=0.81)))[0]) == {0, 1, 2}
    assert set(np.nonzero(filtered_probs(logits, SamplingParams(top_p=0.4)))[0]) == {0}


def test_min_p_drops_tokens_below_fraction_of_max():
    p = np.array([0.4, 0.2, 0.1, 0.05, 0.03, 0.02, 0.1, 0.1])
    kept = np.nonzero(filtered_probs(np.log(p), SamplingParams(min_p=0.25)))[0]
    assert set(kept) == {i for i in range(V) if p[i] >= 0.25 * 0.4}


def test_filters_compose_and_renormalize():
    logits = np.array([3.0, 2.9, 2.8, 1.0, 0.0, -1.0, -2.0, -3.0])
    probs = filtered_probs(logits, SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05))
    assert abs(probs.sum() - 1) < 1e-9
    assert probs[4:].sum() == 0


def test_repetition_penalty_divides_positive_multiplies_negative():
    raw = np.array([2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0], np.float32)
    p = SamplingParams(repetition_penalty=2.0)
    got = processed_logits(raw, p, history=[0, 1, 3], prompt_len=2, num_generated=1)
    np.testing.assert_allclose(got, [1.0, -4.0, 1.0, 0.25, 0, 0, 0, 0])


def test_frequency_and_presence_count_output_tokens_only():
    raw = np.zeros(V, np.float32)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = processed_logits(raw, p, history=[5, 5, 2, 2, 2, 7], prompt_len=2, num_generated=4)
    want = np.zeros(V)
    want[2] = -(0.5 * 3 + 0.25)
    want[7] = -(0.5 * 1 + 0.25)       # token 5 was only in the prompt
    np.testing.assert_allclose(got, want)


def test_logit_bias_steers_greedy():
    logits = [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert sample(logits, SamplingParams(temperature=0, logit_bias={5: 10.0})).token_id == 5
    assert sample(logits, SamplingParams(temperature=0, logit_bias={0: -100.0})).token_id != 0


def test_min_tokens_masks_stop_ids_until_reached():
    logits = [0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    p = SamplingParams(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[1])
    assert sample(logits, p, history=[3, 4], prompt_len=1).token_id != 1      # 1 generated
    assert sample(logits, p, history=[3, 4, 4], prompt_len=1).token_id == 1   # 2 generated


def test_seed_reproducible_and_independent_of_batch():
    logits = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14, 15)]
    seqs = [step(p, seq_id=i) for i, p in enumerate(params)]
    together = [t.token_id for t in sample_step(logits, seqs)]
    alone = [sample_step(logits[i:i + 1], [seqs[i]])[0].token_id for i in range(5)]
    reversed_batch = [t.token_id for t in sample_step(logits[::-1].copy(), seqs[::-1])][::-1]
    assert together == alone == reversed_batch
    # a different step of the same seed draws a fresh number
    draws = {draw(np.full(1000, 1e-3), 7, k) for k in range(20)}
    assert len(draws) > 15


def test_logprobs_are_of_the_raw_distribution():
    logits = np.array([1.0, 2.0, 3.0, 0.0, -1.0, 0.5, 2.5, 0.1], np.float32)
    raw_lp = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    p = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=1.5, logprobs=3, seed=1)
    out = sample(logits, p, history=[2], prompt_len=1)
    assert out.logprob == pytest.approx(raw_lp[out.token_id], abs=1e-5)
    assert [t for t, _ in out.top_logprobs] == [2, 6, 1]
    np.testing.assert_allclose([lp for _, lp in out.top_logprobs], raw_lp[[2, 6, 1]], atol=1e-5)
    assert sample(logits, SamplingParams(temperature=0, logprobs=0)).top_logprobs == []
    assert sample(logits, SamplingParams(temperature=0)).logprob is None


def test_top_logprobs_up_to_20():
    logits = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    out = sample(logits, SamplingParams(temperature=0, logprobs=20))
    assert [t for t, _ in out.top_logprobs] == list(np.argsort(-logits)[:20])
    assert out.top_logprobs[0][0] == out.token_id


def test_repetition_penalty_is_bounded_so_logits_stay_finite():
    import pytest

    from engine.request import SamplingParams
    for bad in (1e-310, 0.0, -1.0, 1e7):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad).validate()
    SamplingParams(repetition_penalty=1e-6).validate()
