"""Free-running greedy gate of every model line (DeepSeek-V4 has its own, tests/models/test_free_running_dsv4.py): the
engine generates 48 greedy tokens per prompt through its real path (a hand-driven EngineLoop: scheduler + numpy
executor; harness/free_running_paths.py) and transformers float32 by full recompute (no KV cache: one forward over
the whole prefix at every step) judges every token (harness/free_running_oracle.py). A token fails where it is not
transformers' greedy one, unless transformers' own gap between the two is inside the tie tolerance measured
teacher-forced on the line (engine vs transformers); the comparison then goes on along the engine's tokens. The
engine's logprob of each token must match transformers' on the same prefix.

Paths: batch 1; batched prompts of mixed lengths; chunked prefill with every chunk edge on a KV-block edge (batch 1,
budget 16) and with chunk edges inside blocks beside running decodes (batched, budget 19); prefix hits (later
requests whose prompts are earlier prompts and 24 of their generated tokens: they read blocks filled in prefill and
in decode, the last one partly, through a block copy), from the device and, in a pool too small to keep them, from
the host KV tier; preemption (a 10-block pool: sequences resume by recompute). Prompts of 1, 15, 17, 33 and 70
tokens (70: two delta-rule chunks of Qwen3.5's prefill), each growing 48 tokens, so decode crosses 3-4 block edges.
Then seeded sweeps of random tiny configurations per line (harness/free_running_models.py) with prompt lengths at
block and delta-rule chunk edges, random budgets and pools.

Bounds (float32 on both sides, as the golden gates; harness/free_running_oracle.py): |Δlogprob| of every generated
token <= 1e-3, and a tie tolerance measured above 1e-3 fails by itself. Measured (2026-12, these models, every
path): max |Δlogprob| of a generated token 2.9e-6 .. 2.0e-5; tie tolerance (twice the largest gap spread over the
longest prompt's run, tie_tolerance) 1.5e-5 (qwen3_untied) .. 4.5e-4 (qwen3_5_text; 5e-4 on the widest sweep
config); no flip, tie or not, here nor over 190 more sweep configs.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from harness.free_running_models import GATE_VOCAB, SWEEP_LINES, gate_model_path, load_oracle, sweep_model, sweep_spec
from harness.free_running_models import LINES as GATE_MODELS
from harness.free_running_oracle import FullRecompute, OracleStep, Run, judge, new_engine, run_greedy, tie_tolerance
from harness.free_running_paths import NEW_TOKENS, GreedyRun, RunPath, engine_greedy
from harness.models import random_sequences

PROMPT_LENS = [1, 15, 17, 33, 70]

PATHS = [
    RunPath("batch1", together=False),
    RunPath("batched"),
    RunPath("chunked-at-block-edges", budget=16, together=False),
    RunPath("chunked-mixed", budget=19),
    RunPath("prefix-hit", together=False, follow_up=24),
    RunPath("prefix-hit-host-tier", together=False, follow_up=24, kv_blocks=7, host_kv_blocks=32),
    RunPath("preempted", kv_blocks=10),
]
PATH = {p.name: p for p in PATHS}
# every line's tiny models (harness/models.py's other variants, qwen3_gqa4 and deepseek_v2_lite, are shapes the
# sweeps draw)
LINES = [name for name in GATE_MODELS if name not in ("qwen3_gqa4", "deepseek_v2_lite")]


def new_executor(model) -> CpuExecutor:
    return CpuExecutor(model, options_of(num_kv_blocks=128, max_model_len=512, max_num_seqs=16, host_kv_blocks=32))


class Gate:
    """A model under the gate: its executor, transformers' full recompute, and the tie tolerance measured on the run
    of `probe` (a prompt) alone."""

    def __init__(self, model, oracle_model, probe: list[int]):
        self.model = model
        self.executor = new_executor(model)
        self.oracle = FullRecompute(oracle_model)
        runs = run_greedy(new_engine(self.executor, model.tokenizer), [probe], NEW_TOKENS)
        self.tie_tol = tie_tolerance(self.executor, self.oracle, runs)

    def failures(self, prompts: list[list[int]], run: RunPath) -> tuple[GreedyRun, list[str]]:
        out = engine_greedy(self.executor, self.model.tokenizer, prompts, run)
        verdicts = [judge(self.oracle, r, self.tie_tol) for r in out.runs]
        ties = [(v.prompt_len, t) for v in verdicts for t in v.ties]
        if ties:
            print(f"{run.name}: ties (prompt length, (step, gap)): {ties}")
        return out, [f"{run.name}: {f}" for v in verdicts for f in v.failures()]


def gate_of(path: str, prompts: list[list[int]]) -> Gate:
    """The gate of the model folder, its tie tolerance measured on the longest of `prompts`."""
    return Gate(load_model(path), load_oracle(path), max(prompts, key=len))


@pytest.fixture(scope="module", params=LINES)
def line(request) -> tuple[Gate, list[list[int]]]:
    """Each line's model (qwen3 tied and untied, llama, qwen2, qwen3_moe, deepseek_v2, deepseek_v3, kimi_k2, qwen3_5
    text and composite) under the gate, and the prompts."""
    prompts = random_sequences(GATE_VOCAB, PROMPT_LENS, seed=11)
    g = gate_of(gate_model_path(request.param), prompts)
    print(f"{request.param}: tie tolerance {g.tie_tol:.3g}")
    return g, prompts


@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_free_running_greedy_is_transformers_full_recompute(line, run):
    gate, prompts = line
    stateful = bool(gate.executor.num_state_slots)        # prefix caching off, no host tier
    if stateful and run.host_kv_blocks:
        pytest.skip("a line with per-sequence state keeps no prefix cache, hence no host KV tier")
    out, failures = gate.failures(prompts[2:4] if run.follow_up else prompts, run)
    assert not failures, failures
    assert_path_taken(run, out, stateful)


def assert_path_taken(run: RunPath, out: GreedyRun, stateful: bool) -> None:
    """The run went the way its path says: follow-ups hit the prefix cache (from the host tier where the path has
    one), a small pool preempted."""
    if run.follow_up and not stateful:
        hits = [r.cached_tokens for r in out.runs[len(out.runs) // 2:]]
        assert all(h >= 16 for h in hits), f"follow-ups did not hit the prefix cache: {hits}"
    assert (out.host_restored_blocks > 0) == bool(run.host_kv_blocks), out.host_restored_blocks
    assert (out.preemptions > 0) == bool(run.kv_blocks and not run.follow_up), out.preemptions


# ---- the gate is able to fail ----------------------------------------------------------------------------------
def test_gate_fails_when_a_partial_prefix_hit_skips_its_block_copy(monkeypatch):
    """A follow-up request whose last shared block is copied from the first request's (copy-on-write): dropping
    the copy leaves that block's rows stale. Only a later request through the prefix cache reads them, so no
    teacher-forced gate can see it; this one does."""
    import engine.executor.cpu as cpu

    prompts, run = random_sequences(GATE_VOCAB, [17], seed=4), PATH["prefix-hit"]
    g = gate_of(gate_model_path("qwen3_tied"), prompts)
    assert not g.failures(prompts, run)[1]
    monkeypatch.setattr(cpu, "copy_pool_blocks", lambda pool, pairs: None)
    g.executor.kv.fill(0)             # (else the block holds, by chance, what the same requests left in it)
    failures = g.failures(prompts, run)[1]
    assert failures and all("prompt of 42 tokens" in f for f in failures), failures     # the follow-up


def test_gate_fails_when_a_sampled_row_is_not_the_last_of_its_chunk(monkeypatch):
    """execute() samples each sequence from the row of its last token; a prefill chunk sampled one row early
    gives the engine a token from the wrong position (forward_logits, what teacher-forced gates read, is right)."""
    from engine.batch import ModelBatch

    prompts = random_sequences(GATE_VOCAB, [9, 20], seed=5)
    g = gate_of(gate_model_path("llama"), prompts)
    assert not g.failures(prompts, PATH["batched"])[1]
    build = ModelBatch.build

    def early(steps, *args, **kwargs):
        batch = build(steps, *args, **kwargs)
        if batch.num_tokens > len(batch.seqs):
            batch.sample_rows = batch.sample_rows - (np.diff(batch.cu_seqlens)[[s.sample for s in batch.seqs]] > 1)
        return batch

    monkeypatch.setattr(ModelBatch, "build", staticmethod(early))
    assert g.failures(prompts, PATH["batched"])[1]


class _Oracle:
    """An oracle whose best token is 7 at every step, with `second` at `gap` nats below it."""

    def __init__(self, second: int, gap: float):
        self.second, self.gap, self.prefixes = second, gap, []

    def step(self, prefix):
        self.prefixes.append(list(prefix))
        return OracleStep(np.array([7, self.second]), np.array([-0.5, -0.5 - self.gap]))


def test_a_flip_inside_the_tie_tolerance_is_a_tie_and_the_run_follows_the_engine():
    run = Run([1, 2], tokens=[7, 8, 7], logprobs=[-0.5, -0.5 - 1e-4, -0.5])
    oracle = _Oracle(second=8, gap=1e-4)
    v = judge(oracle, run, 3e-4)
    assert v.ties == [(1, pytest.approx(1e-4))] and not v.flips and not v.failures()
    assert oracle.prefixes == [[1, 2], [1, 2, 7], [1, 2, 7, 8]]       # re-scored along the engine's tokens


def test_a_flip_outside_the_tolerance_or_off_the_oracles_top_fails_and_so_does_a_wide_tolerance():
    v = judge(_Oracle(second=8, gap=0.01), Run([1], tokens=[8, 9], logprobs=[-0.51, -0.5]), 3e-4)
    assert v.flips == [(0, pytest.approx(0.01)), (1, float("inf"))]
    assert len(v.failures()) == 3                      # two flips, and token 9's logprob unknown
    wide = judge(_Oracle(second=8, gap=1e-4), Run([1], [8], [-0.5001]), 1.0)
    assert wide.ties and wide.failures() == ["prompt of 1 tokens: measured tie tolerance 1 > 0.001"]


def test_the_engines_logprobs_are_checked_on_every_token():
    v = judge(_Oracle(second=8, gap=1.0), Run([1], [7, 7], [-0.5, -0.52]), 0.0)
    assert not v.flips and len(v.failures()) == 1 and "logprob" in v.failures()[0]


# ---- seeded sweeps of random tiny configurations ------------------------------------------------------------------
SWEEP = [(line, seed) for line in SWEEP_LINES for seed in range(2)]


def blocks(tokens: int) -> int:
    return -(-tokens // 16)


def sweep_case(line: str, seed: int) -> tuple[list[int], RunPath, RunPath]:
    """Prompt lengths around KV-block edges (and Qwen3.5's 64-token delta-rule chunks); the prompts batched under a
    random step budget (chunk edges on and inside blocks) in the whole pool or one small enough to preempt; the
    first two alone, then follow-ups hitting their prefixes at a random depth, from the device or (a pool too
    small to keep both) from the host KV tier."""
    rng = random.Random(f"sweep/{line}/{seed}")
    edges = [16, 32, 48] + ([64, 128] if line == "qwen3_5" else [])
    lens = [max(1, e + rng.choice([-1, 0, 1])) for e in rng.sample(edges, 3)]
    budget = rng.choice([16, 32, rng.randint(17, 40), rng.randint(41, 80)])
    pool = rng.choice([None, blocks(max(lens) + NEW_TOKENS) + rng.randint(1, 4)])
    together = RunPath(f"together-budget{budget}-blocks{pool}", budget=budget, kv_blocks=pool)
    tier, depth = rng.random() < 0.5, rng.randint(1, 40)
    prefix = RunPath("prefix-hit-host-tier" if tier else "prefix-hit", together=False, follow_up=depth,
                     budget=rng.choice([16, 512]), host_kv_blocks=32 if tier else 0,
                     kv_blocks=blocks(max(lens[:2]) + depth + 1 + NEW_TOKENS) + 1 if tier else None)
    return lens, together, prefix


@pytest.mark.slow
@pytest.mark.parametrize("line,seed", SWEEP, ids=[f"{line}-{seed}" for line, seed in SWEEP])
def test_sweep_free_running(line, seed):
    lens, together, prefix = sweep_case(line, seed)
    prompts = random_sequences(GATE_VOCAB, lens, seed=seed)
    g = gate_of(sweep_model(line, seed), prompts)
    stateful = bool(g.executor.num_state_slots)
    if stateful:
        prefix = dataclasses.replace(prefix, kv_blocks=None, host_kv_blocks=0)
    out, failures = g.failures(prompts, together)
    prefixed, more = g.failures(prompts[:2], prefix)
    assert not failures + more, (sweep_spec(line, seed), lens, failures + more)
    if not prefix.kv_blocks:
        assert_path_taken(prefix, prefixed, stateful)
