"""Free-running greedy gate: the engine generates greedily through its real path (EngineLoop: the scheduler's
batching, chunked prefill and prefix cache over an executor), and transformers' greedy by full recompute (no KV
cache: one forward over the whole sequence at every step, its last position's argmax) scores every step.

Teacher-forced gates feed both sides the same tokens, so a bug that only incremental decode exercises (state
carried from step to step, a KV block filled by decode tokens, a cached prefix) can hide from them; here the
engine's own tokens are its next inputs, as when it serves.

Per generated token t (prefix = prompt + the engine's tokens before t):
  * flip: the engine's token is not transformers' argmax on the prefix. It is a tie, not a failure, where
    transformers' own gap between its best token and the engine's (its top-2 gap when the engine took the
    second) is inside the tie tolerance; the run then goes on along the engine's tokens, transformers
    re-scoring each step on them (before any flip those prefixes are transformers' own greedy sequence);
  * logprob: the engine's reported logprob of its token against transformers' on the same prefix.
The tie tolerance is measured, not guessed (`EngineSpread`: engine vs transformers float32 at teacher-forced
positions of the same sequence, where both sides see the same tokens; on the GPU the bf16 floor of
tests/test_gpu_free_running.py) and is itself bounded, so a wrong engine cannot widen its own tolerance.

    oracle = FullRecompute(hf_model(path))
    gens = engine_greedy(executor, tokenizer, prompts, RunPath("chunked", budget=16)).generations
    verdicts = judge_all(oracle, gens, EngineSpread(executor, oracle))
    assert not [f for v in verdicts for f in v.failures(max_dlogprob=1e-3)]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.events import Error, Rejected, Scheduled, Token
from engine.request import GenerateRequest, SamplingParams
from harness.models import engine_logits, log_softmax

NEW_TOKENS = 48                 # greedy tokens per request
ORACLE_TOP = 20                 # transformers' best tokens kept per step (the engine's pick is among them, or far off)


# ---- the engine, free-running ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPath:
    """How the engine runs a set of prompts. budget: max_num_batched_tokens (None: the executor's; a prompt
    longer than what is left of it after the step's decodes is prefilled in chunks). together: every prompt
    submitted at once (batched steps of mixed lengths) or each run alone after the last. follow_up: for each
    prompt, a later request whose prompt is that prompt and its first `follow_up` generated tokens plus one fresh
    token, so it hits the prefix cache on blocks filled in prefill and in decode (lines with per-sequence state
    keep prefix caching off: the follow-up then recomputes). kv_blocks: the engine sees only that many blocks of
    the executor's KV pool (None: all); a pool smaller than the prompts need preempts sequences, which resume by
    recomputing their prompt and tokens. host_kv_blocks: the host KV tier's slots (the executor built with as many
    or more), where evicted prefix-cache blocks go and hits come back from."""
    name: str
    budget: int | None = None
    together: bool = True
    follow_up: int = 0
    kv_blocks: int | None = None
    host_kv_blocks: int = 0


@dataclass
class Generation:
    """One request's greedy output through the engine."""
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)      # the engine's logprob of each of its tokens
    cached_tokens: int = 0
    refusal: str | None = None                                # the engine's Error or Rejected event, if any


@dataclass
class GreedyRun:
    generations: list[Generation]
    preemptions: int
    host_restored_blocks: int           # prefix-cache blocks brought back from the host KV tier


def greedy_params(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)


class _Collector:
    """A request's sink: its tokens, logprobs, cached-token count and refusal."""

    def __init__(self, gen: Generation):
        self.gen = gen

    def __call__(self, event) -> None:
        if isinstance(event, (Error, Rejected)):
            self.gen.refusal = repr(event)
        elif isinstance(event, Scheduled):
            self.gen.cached_tokens = event.cached_tokens
        elif isinstance(event, Token):
            self.gen.tokens.append(event.token_id)
            self.gen.logprobs.append(event.logprob)


class _SmallerPool:
    """`executor` as an engine sees it with only its first `blocks` KV blocks (the rest stay unused)."""

    def __init__(self, executor, blocks: int):
        self._executor, self.num_kv_blocks = executor, min(blocks, executor.num_kv_blocks)

    def __getattr__(self, name: str):
        return getattr(self._executor, name)


def new_engine(executor, tokenizer, path: RunPath) -> EngineLoop:
    """An EngineLoop over `executor`, driven by hand (no thread), with path's step budget and KV blocks; prefix
    caching and chunked prefill on, overlap / schedule-ahead / async scheduling as EngineConfig defaults them."""
    opts = executor.options
    if path.kv_blocks:
        executor = _SmallerPool(executor, path.kv_blocks)
    budget = path.budget or opts.max_num_batched_tokens
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=min(opts.max_num_seqs, budget),
                          host_kv_blocks=path.host_kv_blocks)
    return EngineLoop(executor, tokenizer, config, opts.max_model_len, eos_token_ids=[])


def run_engine(engine: EngineLoop, prompts: list[list[int]], new_tokens: int, tag: str) -> list[Generation]:
    """Submit every prompt at once and step the engine until all are done."""
    gens = [Generation(list(p)) for p in prompts]
    for i, g in enumerate(gens):
        engine.add_request(GenerateRequest(f"{tag}{i}", list(g.prompt), greedy_params(new_tokens)), _Collector(g))
    engine.drain_inbox()
    steps = 0
    while engine.has_work():
        engine.step()
        engine.drain_inbox()
        steps += 1
        if steps > 100000:
            raise AssertionError("engine did not finish")
    for g in gens:
        if g.refusal is not None:
            raise AssertionError(f"the engine refused or failed a request: {g.refusal}")
        if len(g.tokens) != new_tokens:
            raise AssertionError(f"engine gave {len(g.tokens)} tokens, asked for {new_tokens}")
    return gens


def engine_greedy(executor, tokenizer, prompts: list[list[int]], path: RunPath,
                  new_tokens: int = NEW_TOKENS) -> GreedyRun:
    """Greedy generations of `prompts` through a fresh EngineLoop over `executor`, as `path` runs them: the prompts'
    generations in order, then (path.follow_up) their follow-ups', sent once every prompt is done, one at a time
    (a pool too small for them all has by then evicted the earlier prompts' blocks: to the host tier if any)."""
    engine = new_engine(executor, tokenizer, path)
    if path.together:
        gens = run_engine(engine, prompts, new_tokens, "r")
    else:
        gens = [g for i, p in enumerate(prompts) for g in run_engine(engine, [p], new_tokens, f"r{i}-")]
    if path.follow_up:
        shared = [g.prompt + g.tokens[:path.follow_up] for g in gens]
        follow = [s + [(s[-1] + 1) % executor.vocab_size] for s in shared]
        gens += [g for i, f in enumerate(follow) for g in run_engine(engine, [f], new_tokens, f"f{i}-")]
    engine.block_manager.check_invariants(idle=True)
    tier = engine.scheduler.host_tier
    return GreedyRun(gens, engine.scheduler.num_preemptions, tier.restored_blocks if tier else 0)


# ---- transformers, full recompute -----------------------------------------------------------------------------
@dataclass(frozen=True)
class OracleStep:
    """transformers' next-token logprobs on one prefix: its top tokens, best first."""
    ids: np.ndarray
    logprobs: np.ndarray

    def logprob_of(self, token: int) -> float | None:
        hit = np.flatnonzero(self.ids == token)
        return float(self.logprobs[hit[0]]) if hit.size else None


class FullRecompute:
    """transformers' greedy by full recompute: each prefix one forward over the whole sequence, no KV cache, the
    last position's logprobs (memoized by prefix, so every path that produces the same tokens reuses them)."""

    def __init__(self, model, top: int = ORACLE_TOP):
        self.model, self.top = model, top
        self._steps: dict[tuple[int, ...], OracleStep] = {}

    def _forward(self, ids: list[int], keep: int):
        import torch
        device = next(self.model.parameters()).device
        threads = torch.get_num_threads()
        torch.set_num_threads(1)            # a tiny model's forward: threads only add their overhead
        try:
            with torch.no_grad():
                out = self.model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=keep)
        finally:
            torch.set_num_threads(threads)
        return out.logits[0].float().cpu().numpy()

    def step(self, prefix: list[int]) -> OracleStep:
        key = tuple(prefix)
        if key not in self._steps:
            lp = log_softmax(self._forward(prefix, 1))[-1]
            top = np.argpartition(-lp, self.top - 1)[:self.top]
            ids = top[np.lexsort((top, -lp[top]))]             # best first, lower id first on a tie
            self._steps[key] = OracleStep(ids, lp[ids])
        return self._steps[key]

    def teacher_forced(self, seq: list[int], start: int) -> np.ndarray:
        """Logits [len(seq) - start, V] of positions start.. in one forward over the sequence."""
        return self._forward(seq, len(seq) - start)


def gap_spread(noisy: np.ndarray, exact: np.ndarray, top: int = ORACLE_TOP) -> np.ndarray:
    """Per position, how far `noisy` moves the gap between any two of `exact`'s `top` best tokens (logits [T, V]
    each; a flip the gate can excuse is between two of them): max - min of the logprob difference over them."""
    best = np.argpartition(-exact, top - 1, axis=-1)[:, :top]
    d = (np.take_along_axis(log_softmax(noisy), best, -1).astype(np.float64)
         - np.take_along_axis(log_softmax(exact), best, -1))
    return d.max(-1) - d.min(-1)


class EngineSpread:
    """The float32 tie tolerance of a generation: the largest gap_spread of the engine (teacher-forced through the
    executor, one prefill of the whole sequence) against transformers over the positions that chose its tokens.
    Measured only where a step flips (memoized by sequence)."""

    def __init__(self, executor, oracle: FullRecompute):
        self.executor, self.oracle = executor, oracle
        self._spreads: dict[tuple[tuple[int, ...], int], float] = {}

    def __call__(self, gen: Generation) -> float:
        seq, start = gen.prompt + gen.tokens[:-1], len(gen.prompt) - 1
        key = (tuple(seq), start)
        if key not in self._spreads:
            engine = engine_logits(self.executor, [seq])[0][start:]
            self._spreads[key] = float(gap_spread(engine, self.oracle.teacher_forced(seq, start)).max())
        return self._spreads[key]


# ---- the verdict ------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """One generation against the oracle, step by step. ties / flips: (step, transformers' gap between its best
    token and the engine's; inf where the engine's is not in its top ORACLE_TOP). tie_tol: measured at the first
    flip (None: no flip)."""
    prompt_len: int
    steps: int
    tie_tol: float | None = None
    ties: list[tuple[int, float]] = field(default_factory=list)
    flips: list[tuple[int, float]] = field(default_factory=list)
    dlogprobs: list[float] = field(default_factory=list)        # |engine - transformers| logprob of each token

    @property
    def max_dlogprob(self) -> float:
        return max(self.dlogprobs, default=0.0)

    def failures(self, max_dlogprob: float, max_tie_tol: float | None = None) -> list[str]:
        where = f"prompt of {self.prompt_len} tokens"
        out = [f"{where}: step {t} is not transformers' greedy token (gap {g:.3g} > tie tolerance {self.tie_tol:.3g})"
               for t, g in self.flips]
        if not self.max_dlogprob <= max_dlogprob:
            out.append(f"{where}: max |dlogprob| of the generated tokens {self.max_dlogprob:.3g} > {max_dlogprob:g}")
        if max_tie_tol is not None and self.tie_tol is not None and not self.tie_tol <= max_tie_tol:
            out.append(f"{where}: measured tie tolerance {self.tie_tol:.3g} > {max_tie_tol:g}")
        return out


def judge(oracle: FullRecompute, gen: Generation, tolerance: Callable[[Generation], float]) -> Verdict:
    """Every step of `gen` against transformers' full recompute on the same prefix; tolerance(gen): its tie
    tolerance, asked for at the first flip."""
    v = Verdict(len(gen.prompt), len(gen.tokens))
    for t, (token, engine_lp) in enumerate(zip(gen.tokens, gen.logprobs)):
        o = oracle.step(gen.prompt + gen.tokens[:t])
        lp = o.logprob_of(token)
        gap = float("inf") if lp is None else float(o.logprobs[0] - lp)
        if token != o.ids[0]:
            v.tie_tol = tolerance(gen) if v.tie_tol is None else v.tie_tol
            (v.ties if gap <= v.tie_tol else v.flips).append((t, gap))
        v.dlogprobs.append(float("inf") if lp is None else abs(engine_lp - lp))
    return v


def judge_all(oracle: FullRecompute, gens: list[Generation], tolerance: Callable[[Generation], float]) -> list[Verdict]:
    return [judge(oracle, g, tolerance) for g in gens]
