"""The CPU executor's step cost model (engine/executor/cpu_cost.py) against the executor itself: the
ratios of measured step times (CPU time, one BLAS thread, medians) that the model must reproduce on the
machine the tests run on. Ratios, not seconds, so a loaded or faster machine moves both sides alike."""
from __future__ import annotations

import time

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.step_budget import StepBudget
from memory.kv_pool import blocks_for

SHAPES = {"one decode": (1, 16), "8 decodes": (8, 16), "8 decodes at 1,000": (8, 1000)}


@pytest.fixture(scope="module")
def demo_executor():
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from engine.loader.demo import demo_model_path

    pool = 8 * blocks_for(1001) + 1
    return CpuExecutor(load_model(demo_model_path()), options_of(max_model_len=2048, num_kv_blocks=pool,
                                                                 cpu_threads=1))


def decode_batch(decodes: int, context: int) -> ModelBatch:
    per = blocks_for(context + 1)
    order = np.random.default_rng(0).permutation(decodes * per).tolist()
    return ModelBatch.build([SeqStep(i, [5], context, order[i * per:(i + 1) * per], True) for i in range(decodes)])


def measured(ex, decodes: int, context: int, reps: int = 5) -> float:
    batch, times = decode_batch(decodes, context), []
    for _ in range(reps):
        t = time.process_time()
        ex.execute(batch)
        times.append(time.process_time() - t)
    return float(np.median(times))


def modelled(ex, decodes: int, context: int) -> float:
    budget = StepBudget.of(ex.options.max_num_batched_tokens, ex.step_cost)
    for _ in range(decodes):
        budget.spend(context, 1, prefill=False)
    return budget.time()


def test_the_model_prices_decode_steps_as_the_executor_runs_them(demo_executor):
    """8 decodes cost ~3x one (the linear layers' matrix products read the weights at a third of a
    matrix-vector product's rate: a 'fixed' part of the step that grows from one row to two), and a longer
    context adds its K and V reads: the model's ratios within 35% of the measured ones."""
    ex = demo_executor
    ex.threads.for_step(1)
    times = {name: (measured(ex, *shape), modelled(ex, *shape)) for name, shape in SHAPES.items()}
    base_measured, base_model = times["one decode"]
    for name, (seconds, model) in times.items():
        ratio, model_ratio = seconds / base_measured, model / base_model
        assert model_ratio == pytest.approx(ratio, rel=0.35), (name, times)
