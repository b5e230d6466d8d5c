"""The free-running greedy gate (harness/free_running_oracle.py, harness/free_running_paths.py) on the GPU executor,
CUDA-graph decode and eager steps, through the engine loop as it serves (overlapped steps, decode planned and
launched ahead): every line's tiny model but DeepSeek-V4's (harness/free_running_models.py; its own in
test_gpu_free_running_dsv4.py) and test_free_running's
prompts and paths (batch 1, batched, chunked prefill at and inside KV-block edges, a prefix hit from the device and
from the host KV tier, preemption), 48 greedy tokens a prompt, against transformers float32 by full recompute on
the same GPU.

The GPU computes in bf16, so the floor method of DESIGN.md sets the bounds, HF bf16 vs HF float32 measured on the
same sequences (the path's runs, teacher-forced):
  * tie tolerance: the largest change HF bf16 makes to the gap between float32's two best tokens at the runs'
    positions, at least 0.02 nats; a flip whose float32 gap is wider fails, except that a path may flip as often
    as HF bf16 itself misses float32's pick by more than that tolerance on the same positions (its rounding flips
    near-ties too), plus one;
  * logprobs: mean |Δlogprob| of the generated tokens (engine vs float32) <= max(0.02, 2 x HF bf16's on them).
Every path's figures are printed (GATE-FREE lines) and appended as JSON to $OPENINFER_GATE_LOG when set.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine.loader import load_model
from harness.executors import new_gpu_executor
from harness.free_running_models import GATE_VOCAB, LINES, gate_model_path, load_oracle
from harness.free_running_oracle import FullRecompute, Run, judge
from harness.free_running_paths import engine_greedy
from harness.models import log_softmax, random_sequences
from test_free_running import PATHS, PROMPT_LENS, assert_path_taken

pytestmark = pytest.mark.gpu
MIN_TIE_TOL = 0.02
MIN_MEAN_DLOGPROB = 0.02


def bf16_floor(exact: FullRecompute, bf16: FullRecompute, runs: list[Run]) -> tuple[float, int, float]:
    """HF bf16 against float32 on the runs teacher-forced: (tie tolerance, HF bf16's picks more than it below
    float32's best, HF bf16's mean |Δlogprob| of the generated tokens)."""
    pairs = []
    for run in runs:
        seq, start = run.prompt + run.tokens[:-1], len(run.prompt) - 1
        l32, l16 = (log_softmax(o.logits(seq, len(seq) - start)[0]) for o in (exact, bf16))
        pairs.append((l32, l16, np.asarray(run.tokens)))
    moved = []
    for l32, l16, _ in pairs:
        best = np.argsort(-l32, axis=-1)[:, :2]
        gap32, gap16 = (np.take_along_axis(lp, best, -1) @ np.array([1.0, -1.0]) for lp in (l32, l16))
        moved.append(np.abs(gap16 - gap32).max())
    tol = max(MIN_TIE_TOL, float(max(moved)))
    misses = sum(int(np.sum(l32.max(-1) - np.take_along_axis(l32, l16.argmax(-1)[:, None], -1)[:, 0] > tol))
                 for l32, l16, _ in pairs)
    d = np.concatenate([np.abs(l16[np.arange(len(t)), t] - l32[np.arange(len(t)), t]) for l32, l16, t in pairs])
    return tol, misses, float(d.mean())


def gate_line(name: str, **settings):
    """Yields (name, model, float32 oracle, bf16 transformers, prompts, executors by cuda_graphs), then closes the
    executors; settings: the executors' own (options_of)."""
    path = gate_model_path(name)
    model = load_model(path)
    exact = FullRecompute(load_oracle(path, "float32", "cuda"))
    bf16 = FullRecompute(load_oracle(path, "bfloat16", "cuda"))
    prompts = random_sequences(GATE_VOCAB, PROMPT_LENS, seed=11)
    executors = {graphs: new_gpu_executor(model, cuda_graphs=graphs, host_kv_blocks=32, **settings)
                 for graphs in (True, False)}
    yield name, model, exact, bf16, prompts, executors
    for ex in executors.values():
        ex.close()


@pytest.fixture(scope="module", params=LINES)
def line(request):
    """gate_line's, built once per line."""
    yield from gate_line(request.param)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_gpu_free_running_greedy(line, run, graphs):
    name, model, exact, bf16, prompts, executors = line
    ex = executors[graphs]
    if ex.num_state_slots and run.host_kv_blocks:
        pytest.skip("a line with per-sequence state keeps no prefix cache, hence no host KV tier")
    out = engine_greedy(ex, model.tokenizer, prompts[2:4] if run.follow_up else prompts, run)
    assert_floor_gate(f"{name}/{run.name}/{'graphs' if graphs else 'eager'}", exact, bf16, out)
    assert_path_taken(run, out, bool(ex.num_state_slots))


def assert_floor_gate(case: str, exact: FullRecompute, bf16: FullRecompute, out) -> dict:
    """The runs of `out` (a GreedyRun) judged by the floor method above; their row printed, logged and returned."""
    tol, hf_misses, hf_mean = bf16_floor(exact, bf16, out.runs)
    verdicts = [judge(exact, r, tol, max_dlogprob=float("inf")) for r in out.runs]
    flips = sum(len(v.flips) for v in verdicts)
    mean = float(np.mean([d for v in verdicts for d in v.dlogprobs]))
    bound = max(MIN_MEAN_DLOGPROB, 2 * hf_mean)
    row = dict(case=case, tokens=sum(v.compared for v in verdicts), tie_tol=tol, flips=flips,
               hf_bf16_misses=hf_misses, ties=sum(len(v.ties) for v in verdicts), mean_dlogprob=mean, bound=bound,
               cached=[r.cached_tokens for r in out.runs], preemptions=out.preemptions,
               host_restored_blocks=out.host_restored_blocks)
    print("GATE-FREE " + json.dumps(row))
    if os.environ.get("OPENINFER_GATE_LOG"):
        with open(os.environ["OPENINFER_GATE_LOG"], "a") as f:
            f.write(json.dumps(row) + "\n")
    assert flips <= hf_misses + 1, (row, [(v.prompt_len, v.flips) for v in verdicts if v.flips])
    assert mean <= bound, row
    return row
