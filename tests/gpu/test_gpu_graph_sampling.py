"""Sampling inside the decode graphs, on a tiny Qwen3 (GQA 4) with the real vocabulary:
  * a step with temperature / top_k / top_p / min_p rows and logprobs is served asynchronously
    (ReadbackStep) and gives exactly what the eager GpuSampler gives on the same logits (ids, logprobs,
    top logprobs, bit for bit), and the host reference's ids; greedy rows keep the argmax;
  * padded rows of the bucket sample nothing and write no top logprobs;
  * greedy steps still replay the greedy graph; steps with penalties still take the eager sampler;
  * graph draws over many seeds follow the filtered softmax distribution (a loose check).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.executor.base import DoneStep
from engine.loader import load_model
from engine.request import SamplingParams
from engine.sampling import filtered_probs, sample_step
from harness.executors import Decoder, new_gpu_executor
from harness.models import random_sequences, tiny_model_path

pytestmark = pytest.mark.gpu

KINDS = [dict(temperature=0.0), dict(temperature=0.8, top_k=40, logprobs=5),
         dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, min_p=0.05, logprobs=0),
         dict(temperature=0.0, logprobs=20), dict(temperature=1.3, top_k=200, top_p=0.95, min_p=0.01, logprobs=3)]


@pytest.fixture(scope="module")
def setup():
    model = load_model(tiny_model_path("qwen3_gqa4"))
    ex = new_gpu_executor(model)
    yield model, ex
    ex.close()


def fetch(ex, a) -> np.ndarray:
    """A device array's contents after the executor's stream has written it."""
    out = a.get(stream=ex.stream)
    ex.stream.synchronize()
    return out


def mixed_params(n: int, step: int) -> list[SamplingParams]:
    """Row i of step s: KINDS[i + s + 1] (a batch of one samples too), some rows unseeded."""
    return [SamplingParams(**KINDS[(i + step + 1) % len(KINDS)], seed=None if i % 7 == 3 else 100 * i + step)
            for i in range(n)]


def test_sampling_graph_equals_eager_sampler(setup):
    from engine.executor.gpu_readback import ReadbackStep

    model, ex = setup
    V, mismatches, total = model.config.vocab_size, 0, 0
    for n in (1, 3, 6, 16):
        dec = Decoder(ex, random_sequences(V, [5 + 3 * i for i in range(n)], seed=n), steps=3)
        b = ex.graphs.bucket(n)
        for step in range(3):
            params = mixed_params(n, step)
            with ex.stream:                            # padded rows must leave these untouched
                ex.sampler.probs[:b].fill(np.nan)
                ex.sampler.top_ids[:b].fill(-7)
            batch = dec.batch(params)
            pending = ex.submit(batch)
            assert isinstance(pending, ReadbackStep), f"batch {n}: a sampling step was not served by a graph"
            got = pending.result()
            logits = ex.graphs.sampling_graphs[b][1]
            if b > n:
                assert np.isnan(fetch(ex, ex.sampler.probs[n:b])).all(), "a padded row sampled"
                assert (fetch(ex, ex.sampler.top_ids[n:b]) == -7).all(), "a padded row wrote top logprobs"
            host_logits = fetch(ex, logits[:n])
            eager = ex.sampler.sample(logits[:n], batch.seqs)
            for g, e, p in zip(got.sampled, eager, params):
                assert (g.seq_id, g.token_id, g.logprob, g.top_logprobs) == \
                    (e.seq_id, e.token_id, e.logprob, e.top_logprobs), (n, step, p)
                assert (g.logprob is None) == (p.logprobs is None)
                assert len(g.top_logprobs) == (p.logprobs or 0)
            ref = sample_step(host_logits, batch.seqs)
            for i, (g, r, p) in enumerate(zip(got.sampled, ref, params)):
                if p.greedy:
                    assert g.token_id == int(np.argmax(host_logits[i])), (n, step, i)
                mismatches += g.token_id != r.token_id
                total += 1
                if g.logprob is not None and g.token_id == r.token_id:
                    assert abs(g.logprob - r.logprob) < 1e-3
                    assert [t for t, _ in g.top_logprobs] == [t for t, _ in r.top_logprobs]
            dec.advance(got)
    print(f"graph sampling vs host reference: {total - mismatches}/{total} ids equal")
    assert mismatches <= 1, f"{mismatches} of {total} graph draws differ from the host reference"
    assert sorted(ex.graphs.sampling_graphs) == [1, 4, 8, 16]


def test_greedy_steps_keep_the_greedy_graph_and_penalties_stay_eager(setup):
    from engine.executor.gpu_readback import ReadbackStep

    model, ex = setup
    dec = Decoder(ex, random_sequences(model.config.vocab_size, [9, 4, 13], seed=5), steps=2)
    greedy_before = dict(ex.graphs.graphs)
    pending = ex.submit(dec.batch([SamplingParams(temperature=0.0)] * 3))
    assert isinstance(pending, ReadbackStep) and pending.logprobs is None
    got = pending.result()
    logits = fetch(ex, ex.graphs.graphs[4][1][:3])
    assert [t.token_id for t in got.sampled] == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top_logprobs == [] for t in got.sampled)
    assert all(greedy_before[b][0] is ex.graphs.graphs[b][0] for b in greedy_before)   # no re-capture
    dec.advance(got)
    params = [SamplingParams(temperature=0.9, seed=1, repetition_penalty=1.3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, seed=2, logprobs=2)]
    batch = dec.batch(params)
    pending = ex.submit(batch)
    assert isinstance(pending, DoneStep), "a step with penalties left the eager sampler"
    got = pending.result()
    ref = sample_step(fetch(ex, ex.graphs.graphs[4][1][:3]), batch.seqs)
    assert [t.token_id for t in got.sampled] == [t.token_id for t in ref]


def test_graph_draws_follow_the_filtered_distribution(setup):
    """Rows of one prompt decode the same step again and again with new seeds: the draws' histogram
    matches filtered_probs of the (unchanging) logits within a loose total-variation bound."""
    model, ex = setup
    n, replays = 16, 256
    prompt = random_sequences(model.config.vocab_size, [11], seed=9)[0]
    dec = Decoder(ex, [prompt] * n, steps=1)
    draws, first = [], None
    for r in range(replays):
        params = [SamplingParams(temperature=0.8, top_k=6, seed=r * n + i) for i in range(n)]
        got = ex.submit(dec.batch(params)).result()        # same tokens, positions, KV: same logits
        draws += [t.token_id for t in got.sampled]
        logits = fetch(ex, ex.graphs.sampling_graphs[16][1][:n])
        if first is None:
            first = logits
    np.testing.assert_array_equal(logits, first)
    want = np.mean([filtered_probs(row, SamplingParams(temperature=0.8, top_k=6)) for row in first], axis=0)
    support = np.flatnonzero(want)
    assert set(draws) <= set(support.tolist()), "a draw outside the top-k support"
    freq = np.bincount(draws, minlength=want.shape[0])[support] / len(draws)
    tv = 0.5 * float(np.abs(freq - want[support]).sum())
    print(f"{len(draws)} draws over {support.size} tokens: total variation {tv:.4f}")
    assert tv < 0.05, (freq, want[support])
