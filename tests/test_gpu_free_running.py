"""The free-running greedy gate (harness/free_running.py) on the GPU executor, CUDA-graph decode and eager steps,
through the engine loop as it serves (overlapped steps, decode planned and launched ahead): every line's tiny model
(harness/free_running_models.py; DeepSeek-V4 has its own) and test_free_running's prompts and paths (batch 1,
batched, chunked prefill at and inside KV-block edges, a prefix hit from the device and from the host KV tier,
preemption), 48 greedy tokens a prompt, against transformers float32 by full recompute on the same GPU.

The GPU computes in bf16, so the floor method of DESIGN.md sets the bounds, HF bf16 vs HF float32 measured on the
same sequences:
  * tie tolerance of a generation: the largest change HF bf16 makes to the gap between float32's two best tokens
    at its positions (gap_spread, top 2), at least 0.02 nats; a flip whose float32 gap is wider fails, except that
    a path may flip as often as HF bf16 itself misses float32's pick by more than that tolerance on the flipped
    generations (its rounding flips near-ties too), plus one;
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
from harness.free_running import FullRecompute, Generation, engine_greedy, gap_spread, judge_all
from harness.free_running_models import LINES, gate_model_path, load_oracle
from harness.models import log_softmax, random_sequences
from test_free_running import PATHS, PROMPT_LENS, assert_path_taken

pytestmark = pytest.mark.gpu
MIN_TIE_TOL = 0.02
MIN_MEAN_DLOGPROB = 0.02


class Bf16Floor:
    """Per generation (memoized): HF bf16 and float32 teacher-forced on it; the tie tolerance, HF bf16's misses at
    it, and HF bf16's |Δlogprob| of the generated tokens."""

    def __init__(self, exact: FullRecompute, bf16: FullRecompute):
        self.exact, self.bf16 = exact, bf16
        self._floors: dict[tuple[int, ...], tuple[float, int, np.ndarray]] = {}

    def floor(self, gen: Generation) -> tuple[float, int, np.ndarray]:
        seq, start = gen.prompt + gen.tokens, len(gen.prompt) - 1
        key = tuple(seq)
        if key not in self._floors:
            l32 = self.exact.teacher_forced(seq[:-1], start)
            l16 = self.bf16.teacher_forced(seq[:-1], start)
            tol = max(MIN_TIE_TOL, float(gap_spread(l16, l32, top=2).max()))
            lp32, lp16, rows = log_softmax(l32), log_softmax(l16), np.arange(len(l32))
            misses = int(np.sum(lp32.max(-1) - lp32[rows, lp16.argmax(-1)] > tol))
            picks = np.asarray(gen.tokens)
            self._floors[key] = (tol, misses, np.abs(lp16[rows, picks] - lp32[rows, picks]))
        return self._floors[key]

    def __call__(self, gen: Generation) -> float:
        return self.floor(gen)[0]


@pytest.fixture(scope="module", params=LINES)
def line(request):
    """(name, model, float32 oracle, bf16 floor, prompts, executors by cuda_graphs: built once per line)."""
    path = gate_model_path(request.param)
    model = load_model(path)
    exact = FullRecompute(load_oracle(path, "float32", "cuda"))
    floor = Bf16Floor(exact, FullRecompute(load_oracle(path, "bfloat16", "cuda")))
    prompts = random_sequences(model.config.vocab_size, PROMPT_LENS, seed=11)
    executors = {graphs: new_gpu_executor(model, cuda_graphs=graphs, host_kv_blocks=32) for graphs in (True, False)}
    yield request.param, model, exact, floor, prompts, executors
    for ex in executors.values():
        ex.close()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_gpu_free_running_greedy(line, run, graphs):
    name, model, exact, floor, prompts, executors = line
    ex = executors[graphs]
    if ex.num_state_slots and run.host_kv_blocks:
        pytest.skip("a line with per-sequence state keeps no prefix cache, hence no host KV tier")
    out = engine_greedy(ex, model.tokenizer, prompts[2:4] if run.follow_up else prompts, run)
    gens = out.generations
    verdicts = judge_all(exact, gens, floor)
    flips = sum(len(v.flips) for v in verdicts)
    allowed = sum(floor.floor(g)[1] + 1 for g, v in zip(gens, verdicts) if v.flips)
    mean = float(np.mean([d for v in verdicts for d in v.dlogprobs]))
    bound = max(MIN_MEAN_DLOGPROB, 2 * float(np.mean(np.concatenate([floor.floor(g)[2] for g in gens]))))
    row = dict(case=f"{name}/{run.name}/{'graphs' if graphs else 'eager'}", tokens=sum(v.steps for v in verdicts),
               flips=flips, allowed_flips=allowed, ties=sum(len(v.ties) for v in verdicts),
               tie_tols=[v.tie_tol for v in verdicts if v.tie_tol is not None], mean_dlogprob=mean, bound=bound,
               cached=[g.cached_tokens for g in gens], preemptions=out.preemptions,
               host_restored_blocks=out.host_restored_blocks)
    print("GATE-FREE " + json.dumps(row))
    if os.environ.get("OPENINFER_GATE_LOG"):
        with open(os.environ["OPENINFER_GATE_LOG"], "a") as f:
            f.write(json.dumps(row) + "\n")
    assert flips <= allowed, (row, [(v.prompt_len, v.flips) for v in verdicts if v.flips])
    assert mean <= bound, row
    assert_path_taken(run, out, bool(ex.num_state_slots))
