"""Eager (prefill and mixed) steps come back like graphed decode steps: launched, returned at once as a
ReadbackStep, with exactly the ids and logprobs the synchronous GpuSampler gives on the same logits;
steps with logit processing or prompt logprobs still run to the end."""
from __future__ import annotations

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.base import DoneStep
from engine.loader import load_model
from engine.request import SamplingParams
from harness.executors import new_gpu_executor
from harness.models import random_sequences, tiny_model_path
from test_gpu_graph_sampling import KINDS

pytestmark = pytest.mark.gpu


def mixed_step(vocab: int, params: list[SamplingParams]) -> ModelBatch:
    """A prefill of 40 tokens, chunks and decodes: every row samples."""
    lens = [40, 1, 17, 1, 1, 9][:len(params)]
    seqs = random_sequences(vocab, lens, seed=3)
    steps, at = [], 0
    for i, (ids, p) in enumerate(zip(seqs, params)):
        blocks = list(range(at, at + 4))
        at += 4
        steps.append(SeqStep(seq_id=i, token_ids=ids, start_pos=0, block_table=blocks, sample=True, params=p,
                             prompt_len=len(ids), history=list(ids)))
    return ModelBatch.build(steps)


def test_eager_steps_return_before_the_gpu_finishes_with_the_eager_samplers_tokens():
    from engine.executor.gpu_readback import ReadbackStep

    model = load_model(tiny_model_path("qwen3_gqa4"))
    ex = new_gpu_executor(model, cuda_graphs=False)
    try:
        params = [SamplingParams(**KINDS[i % len(KINDS)], seed=7 * i) for i in range(6)]
        batch = mixed_step(model.config.vocab_size, params)
        pending = ex.submit(batch)
        assert isinstance(pending, ReadbackStep)
        got = pending.result().sampled
        ex2 = new_gpu_executor(model, cuda_graphs=False)        # the same step, the synchronous sampler
        try:
            hidden, ctx = ex2._hidden(batch)
            logits = ex2.model.compute_logits(ex2.ops, ex2.weights, ex2.ops.gather_rows(hidden, ctx.sample_rows))
            ref = ex2.sampler.sample(logits, batch.seqs)
        finally:
            ex2.close()
        assert [t.token_id for t in got] == [t.token_id for t in ref]
        for g, r in zip(got, ref):
            assert (g.logprob is None) == (r.logprob is None)
            if g.logprob is not None:
                assert abs(g.logprob - r.logprob) < 1e-4
                assert [t for t, _ in g.top_logprobs] == [t for t, _ in r.top_logprobs]
        penalised = [SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 2
        assert isinstance(ex.submit(mixed_step(model.config.vocab_size, penalised)), DoneStep)
        assert np.isfinite(ex.last_host_s)
    finally:
        ex.close()


@pytest.mark.parametrize("graphs", [True, False])
def test_async_scheduling_gives_the_same_tokens_on_the_gpu(graphs):
    """Decode steps queued before the step ahead is read, their input ids copied on the device from
    that step's sampled ids (graphed and eager): every request's tokens equal the engine's without."""
    from engine.config import EngineConfig
    from engine.handle import EngineHandle

    path = tiny_model_path("qwen3_gqa4")
    prompts = random_sequences(50000, [5, 33, 17, 64, 9], seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=20, ignore_eos=True, logprobs=2)]
    runs = {}
    for on in (False, True):
        config = EngineConfig(model=path, device="cuda", max_model_len=256, num_kv_blocks=128, progress=False,
                              async_scheduling=on, enforce_eager=not graphs)
        with EngineHandle(config) as h:
            runs[on] = [[o.outputs[0].token_ids for o in h.generate(prompts, p)] for p in params]
            if on:
                assert h.engine.stats().num_steps_planned_ahead > 20
    assert runs[True] == runs[False]
