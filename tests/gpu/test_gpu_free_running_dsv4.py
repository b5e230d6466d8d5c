"""The DeepSeek-V4 free-running gate on the GPU executor (decode steps in its CUDA graphs, the others eager): the
issue's model of tests/models/test_free_running_dsv4.py, 48 greedy tokens a prompt alone, batched with chunked prefill
(steps of 16 tokens next to decodes) and as follow-ups hitting the prefix cache (restoring whole blocks, replaying the
tokens the compressor rings need before them), against transformers float32 by
full recompute on the same GPU with the indexer's tie rule (harness/dsv4_oracle.py), judged by the floor method of
tests/gpu/test_gpu_free_running.py (HF bf16 vs float32 measured on the same runs). The engine takes the indexer's q from a
bf16 GEMM and its keys from bf16 KV rows, so an index choice is fragile (a flip there a fork, not a fault) when a bf16 ulp of each factor
(2^-8 relative, BF16_INDEX_NOISE together) could reorder it; the CPU gate holds float32 noise. The same gate with
speculation on (an executor built for K drafts: rings K rows longer), as tests/gpu/test_gpu_spec.py runs it."""
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
from test_gpu_spec import K, NGRAM, ReferenceProposer, assert_divergences_are_ties

pytestmark = pytest.mark.gpu
BF16_INDEX_NOISE = 2 * 2 ** -8
PATHS = [RunPath("batch1", together=False), RunPath("batched-chunked", budget=16),
         RunPath("prefix-hit", together=False, follow_up=20)]


@functools.lru_cache(maxsize=None)
def issue_path() -> str:
    return build_tiny_model("deepseek_v4", os.path.join(_tmp_root(), "issue-gpu"), seed=0, **ISSUE)


@pytest.fixture(scope="module")
def issue_gpu():
    """(engine model, GPU executor, transformers float32 and bf16 on the GPU with the tie rule)."""
    path = issue_path()
    model = load_model(path)
    rule = functools.partial(index_tie_rule, rel=BF16_INDEX_NOISE)
    exact, bf16 = (FullRecompute(load_oracle(path, dtype, "cuda"), rule) for dtype in ("float32", "bfloat16"))
    ex = new_gpu_executor(model)
    yield model, ex, exact, bf16
    ex.close()


@pytest.fixture(scope="module")
def spec_executor():
    """A GPU executor built for K draft tokens on its own load of the model (its rings K rows longer)."""
    ex = new_gpu_executor(load_model(issue_path()), num_speculative_tokens=K)
    yield ex
    ex.close()


@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_gpu_dsv4_free_running(issue_gpu, run):
    model, ex, exact, bf16 = issue_gpu
    prompts = prompts_of(random.Random(0), [32, 24, 5])
    out = engine_greedy(ex, model.tokenizer, prompts, run)
    assert_floor_gate(f"deepseek_v4/{run.name}/eager", exact, bf16, out)
    for first, hit in zip(out.runs, out.runs[len(prompts):] if run.follow_up else []):
        assert_replayed(ISSUE, first, run.follow_up, hit)


@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_gpu_dsv4_speculative(issue_gpu, spec_executor, run):
    """Verify steps on the device attention (a step's k + 1 rows a sequence stored, compressed and attended like
    a prefill's, rejected drafts' ring rows never read): the floor gate with drafts from the spec-off run 30% wrong
    and every one wrong (next to nothing accepted: every step's drafts land in the rings' draft rows, unread), each
    run's partings from the spec-off run near ties only. Not exact between the two, as the dense lines are
    (test_gpu_spec.py): a token's row rounds otherwise in a verify step than in a one-row decode graph (the MoE
    grouping, the prefill-style
    attention; 0.056 nats at most on the emulation, tests/kernels/test_dsv4_gpu_emulated.py), and which step
    holds which row depends on what was accepted (H100, 2026-12-07: the two runs parted on every path, the
    30%-wrong one within the floor gate with no flips)."""
    model, _, exact, bf16 = issue_gpu
    prompts = prompts_of(random.Random(0), [32, 24, 5])
    off = engine_greedy(spec_executor, model.tokenizer, prompts, run)
    on = {wrong: engine_greedy(spec_executor, model.tokenizer, prompts, run,
                               speculation=(NGRAM, ReferenceProposer(off.runs, wrong, spec_executor.vocab_size)))
          for wrong in (0.3, 1.0)}
    assert on[0.3].accepted_drafts > 10 and on[1.0].accepted_drafts < on[0.3].accepted_drafts
    for wrong, spec in on.items():
        row = assert_floor_gate(f"deepseek_v4/spec{wrong}/{run.name}", exact, bf16, spec)
        assert_divergences_are_ties(exact, off, spec, row["tie_tol"], row["hf_bf16_misses"] + 1)
