"""Free-running greedy gate of every model line (DeepSeek-V4 has its own): the engine generates 48 greedy tokens
per prompt through its real path (EngineLoop: scheduler + numpy executor) and transformers float32 by full
recompute (no KV cache) scores every step (harness/free_running.py). A step fails where the engine's token is not
transformers' greedy token, unless transformers' own gap between the two is inside the tie tolerance measured on
the same sequence (engine vs transformers, teacher-forced); the run goes on along the engine's tokens. The engine's
logprob of each token must match transformers' on the same prefix.

Paths: batch 1; batched prompts of mixed lengths; chunked prefill with every chunk edge on a KV-block edge (batch 1,
budget 16) and with chunk edges inside blocks beside running decodes (batched, budget 19); a prefix hit (a second
request whose prompt is the first's prompt and 24 of its generated tokens: it reads blocks filled in prefill and in
decode, the last one partly, through a block copy). Prompts of 1, 15, 17, 33 and 70 tokens (70: two delta-rule
chunks of Qwen3.5's prefill), each growing 48 tokens, so decode crosses 3-4 block edges. Then seeded sweeps of random
tiny configurations per line (harness/free_running_models.py) with prompt lengths at block edges and random budgets.

Bounds (float32 on both sides, as the golden gates): |Δlogprob| of every generated token <= 1e-3, and a tie
tolerance measured above 2e-3 fails by itself. Measured (2026-12): max |Δlogprob| 4e-6 .. 1.2e-5 over the lines and
paths, teacher-forced tie tolerance (largest gap spread) 2e-5 .. 6e-5; no flip, tie or not, on these models.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from harness.free_running import (EngineSpread, FullRecompute, Generation, GreedyRun, OracleStep, RunPath,
                                  engine_greedy, judge, judge_all)
from harness.free_running_models import LINES, gate_model_path, load_oracle, sweep_model, sweep_spec
from harness.models import random_sequences

MAX_DLOGPROB = 1e-3
MAX_TIE_TOL = 2 * MAX_DLOGPROB
PROMPT_LENS = [1, 15, 17, 33, 70]

PATHS = [
    RunPath("batch1", together=False),
    RunPath("batched"),
    RunPath("chunked-at-block-edges", budget=16, together=False),
    RunPath("chunked-mixed", budget=19),
    RunPath("prefix-hit", together=False, follow_up=24),
    RunPath("preempted", kv_blocks=10),
]


def new_executor(model) -> CpuExecutor:
    return CpuExecutor(model, options_of(num_kv_blocks=128, max_model_len=512, max_num_seqs=16))


class Gate:
    """A model under the gate: its executor, transformers' full recompute, the tie tolerance."""

    def __init__(self, path: str):
        self.model = load_model(path)
        self.executor = new_executor(self.model)
        self.oracle = FullRecompute(load_oracle(path))
        self.tolerance = EngineSpread(self.executor, self.oracle)

    def failures(self, prompts: list[list[int]], run: RunPath) -> tuple[GreedyRun, list[str]]:
        out = engine_greedy(self.executor, self.model.tokenizer, prompts, run)
        verdicts = judge_all(self.oracle, out.generations, self.tolerance)
        ties = [(v.prompt_len, t) for v in verdicts for t in v.ties]
        if ties:
            print(f"{run.name}: ties (prompt length, (step, gap)): {ties}")
        return out, [f"{run.name}: {f}" for v in verdicts for f in v.failures(MAX_DLOGPROB, MAX_TIE_TOL)]


@pytest.fixture(scope="module", params=LINES)
def gate(request):
    g = Gate(gate_model_path(request.param))
    g.prompts = random_sequences(g.model.config.vocab_size, PROMPT_LENS, seed=11)
    return g


@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_free_running_greedy_is_transformers_full_recompute(gate, run):
    prompts = gate.prompts[2:4] if run.follow_up else gate.prompts
    out, failures = gate.failures(prompts, run)
    assert not failures, failures
    if run.follow_up and not gate.executor.num_state_slots:     # a line with state keeps prefix caching off
        hits = [g.cached_tokens for g in out.generations[1::2]]
        assert all(h >= 16 for h in hits), f"follow-ups did not hit the prefix cache: {hits}"
    assert (out.preemptions > 0) == bool(run.kv_blocks), out.preemptions


def test_tie_tolerance_is_measured_small():
    """The tolerance a flip would be judged by: engine vs transformers teacher-forced on a generated sequence, the
    largest change of any two tokens' gap; float32 on both sides keeps it far under the cap."""
    g = Gate(gate_model_path("qwen3_untied"))
    gens = engine_greedy(g.executor, g.model.tokenizer, random_sequences(4096, [20], seed=2), PATHS[0]).generations
    tol = g.tolerance(gens[0])
    print(f"tie tolerance {tol:.3g}")
    assert 0 < tol <= MAX_TIE_TOL / 10


# ---- the gate is able to fail ----------------------------------------------------------------------------------
def test_gate_fails_when_a_partial_prefix_hit_skips_its_block_copy(monkeypatch):
    """A follow-up request whose last shared block is copied from the first request's (copy-on-write): dropping
    the copy leaves that block's rows stale. Only a second request through the prefix cache reads them, so no
    teacher-forced gate can see it; this one does."""
    import engine.executor.cpu as cpu

    g = Gate(gate_model_path("qwen3_tied"))
    prompts, run = random_sequences(g.model.config.vocab_size, [17], seed=4), PATHS[-1]
    assert not g.failures(prompts, run)[1]
    monkeypatch.setattr(cpu, "copy_pool_blocks", lambda pool, pairs: None)
    g.executor.kv.fill(0)             # (else the block holds, by chance, what the same requests left in it)
    failures = g.failures(prompts, run)[1]
    assert failures and all("prompt of 42 tokens" in f for f in failures), failures


def test_gate_fails_when_a_sampled_row_is_not_the_last_of_its_chunk(monkeypatch):
    """execute() samples each sequence from the row of its last token; a prefill chunk sampled one row early
    gives the engine a token from the wrong position (forward_logits, what teacher-forced gates read, is right)."""
    from engine.batch import ModelBatch

    g = Gate(gate_model_path("llama"))
    prompts = random_sequences(g.model.config.vocab_size, [9, 20], seed=5)
    assert not g.failures(prompts, PATHS[1])[1]
    build = ModelBatch.build

    def early(steps, *args, **kwargs):
        batch = build(steps, *args, **kwargs)
        if batch.num_tokens > len(batch.seqs):
            batch.sample_rows = batch.sample_rows - (np.diff(batch.cu_seqlens)[[s.sample for s in batch.seqs]] > 1)
        return batch

    monkeypatch.setattr(ModelBatch, "build", staticmethod(early))
    assert g.failures(prompts, PATHS[1])[1]


class _Oracle:
    """An oracle whose best token is 7 at every step, with `second` at `gap` nats below it."""

    def __init__(self, second: int, gap: float):
        self.second, self.gap, self.prefixes = second, gap, []

    def step(self, prefix):
        self.prefixes.append(list(prefix))
        return OracleStep(np.array([7, self.second]), np.array([-0.5, -0.5 - self.gap]))


def test_a_flip_inside_the_tie_tolerance_is_a_tie_and_the_run_follows_the_engine():
    gen = Generation([1, 2], tokens=[7, 8, 7], logprobs=[-0.5, -0.5 - 1e-4, -0.5])
    oracle = _Oracle(second=8, gap=1e-4)
    v = judge(oracle, gen, lambda g: 3e-4)
    assert v.ties == [(1, pytest.approx(1e-4))] and not v.flips and v.tie_tol == 3e-4
    assert oracle.prefixes == [[1, 2], [1, 2, 7], [1, 2, 7, 8]]       # re-scored along the engine's tokens
    assert not v.failures(MAX_DLOGPROB, MAX_TIE_TOL)


def test_a_flip_outside_the_tolerance_or_off_the_oracles_top_fails():
    gen = Generation([1], tokens=[8, 9], logprobs=[-0.51, -0.5])
    v = judge(_Oracle(second=8, gap=0.01), gen, lambda g: 3e-4)
    assert v.flips == [(0, pytest.approx(0.01)), (1, float("inf"))]
    assert len(v.failures(MAX_DLOGPROB)) == 3                      # two flips, and token 9's logprob unknown
    no_tolerance = judge(_Oracle(second=8, gap=1e-4), Generation([1], [8], [-0.5001]), lambda g: 1.0)
    assert no_tolerance.failures(MAX_DLOGPROB, MAX_TIE_TOL) == [
        "prompt of 1 tokens: measured tie tolerance 1 > 0.002"]


def test_the_engines_logprobs_are_checked_on_every_token():
    v = judge(_Oracle(second=8, gap=1.0), Generation([1], [7, 7], [-0.5, -0.52]), lambda g: 0.0)
    assert not v.flips and v.failures(MAX_DLOGPROB) == [
        "prompt of 1 tokens: max |dlogprob| of the generated tokens 0.02 > 0.001"]


# ---- seeded sweeps of random tiny configurations ------------------------------------------------------------------
SWEEP = [(line, seed) for line in ("qwen3", "llama", "qwen2", "qwen3_moe", "deepseek_v2", "deepseek_v3", "qwen3_5")
         for seed in range(2)]


def sweep_case(line: str, seed: int) -> tuple[list[int], list[RunPath]]:
    """Prompt lengths around KV-block edges (and Qwen3.5's 64-token delta-rule chunks), a random step budget that
    puts chunk edges inside blocks or on them, and a prefix hit at a random depth into the first generation."""
    rng = random.Random(f"sweep/{line}/{seed}")
    edges = [16, 32, 48] + ([64, 128] if line == "qwen3_5" else [])
    lens = [max(1, e + rng.choice([-1, 0, 1])) for e in rng.sample(edges, 3)]
    budget = rng.choice([16, 32, rng.randint(17, 40), rng.randint(41, 80)])
    pool = rng.choice([None, -(-(max(lens) + 48) // 16) + rng.randint(1, 4)])        # small: preempts
    return lens, [RunPath(f"together-budget{budget}-blocks{pool}", budget=budget, kv_blocks=pool),
                  RunPath("prefix-hit", together=False, follow_up=rng.randint(1, 40), budget=rng.choice([16, 512]))]


@pytest.mark.slow
@pytest.mark.parametrize("line,seed", SWEEP, ids=[f"{line}-{seed}" for line, seed in SWEEP])
def test_sweep_free_running(line, seed):
    lens, runs = sweep_case(line, seed)
    g = Gate(sweep_model(line, seed))
    prompts = random_sequences(g.model.config.vocab_size, lens, seed=seed)
    failures = []
    for run in runs:
        failures += g.failures(prompts if run.together else prompts[:1], run)[1]
    assert not failures, (sweep_spec(line, seed), lens, failures)
