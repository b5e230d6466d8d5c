"""The DeepSeek-V4 free-running gate on the GPU executor (eager steps: the line captures no CUDA graphs): the
issue's model of tests/models/test_free_running_dsv4.py, 48 greedy tokens a prompt alone, batched with chunked prefill
(steps of 16 tokens next to decodes) and as follow-ups hitting the prefix cache (restoring whole blocks, replaying the
tokens the compressor rings need before them), against transformers float32 by
full recompute on the same GPU with the indexer's tie rule (harness/dsv4_oracle.py), judged by the floor method of
tests/gpu/test_gpu_free_running.py (HF bf16 vs float32 measured on the same runs). The engine takes the indexer's q from a
bf16 GEMM and its keys from bf16 KV rows, so an index choice is fragile (a flip there a fork, not a fault) when a bf16 ulp of each factor
(2^-8 relative, BF16_INDEX_NOISE together) could reorder it; the CPU gate holds float32 noise."""
from __future__ import annotations

import functools
import os
import random

import pytest

from engine.loader import load_model
from harness.dsv4_oracle import index_tie_rule
from harness.executors import new_gpu_executor
from harness.free_running_models import load_oracle
from harness.free_running_oracle import FullRecompute
from harness.free_running_paths import RunPath, engine_greedy
from harness.models import _tmp_root, build_tiny_model
from test_free_running_dsv4 import ISSUE, assert_replayed, prompts_of
from test_gpu_free_running import assert_floor_gate

pytestmark = pytest.mark.gpu
BF16_INDEX_NOISE = 2 * 2 ** -8
PATHS = [RunPath("batch1", together=False), RunPath("batched-chunked", budget=16),
         RunPath("prefix-hit", together=False, follow_up=20)]


@pytest.fixture(scope="module")
def issue_gpu():
    """(engine model, GPU executor, transformers float32 and bf16 on the GPU with the tie rule)."""
    path = build_tiny_model("deepseek_v4", os.path.join(_tmp_root(), "issue-gpu"), seed=0, **ISSUE)
    model = load_model(path)
    rule = functools.partial(index_tie_rule, rel=BF16_INDEX_NOISE)
    exact, bf16 = (FullRecompute(load_oracle(path, dtype, "cuda"), rule) for dtype in ("float32", "bfloat16"))
    ex = new_gpu_executor(model)
    yield model, ex, exact, bf16
    ex.close()


@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_gpu_dsv4_free_running(issue_gpu, run):
    model, ex, exact, bf16 = issue_gpu
    prompts = prompts_of(random.Random(0), [32, 24, 5])
    out = engine_greedy(ex, model.tokenizer, prompts, run)
    assert_floor_gate(f"deepseek_v4/{run.name}/eager", exact, bf16, out)
    for first, hit in zip(out.runs, out.runs[len(prompts):] if run.follow_up else []):
        assert_replayed(ISSUE, first, run.follow_up, hit)
