"""Free-running greedy gate, generic part: the engine generates greedily through its real path (a hand-driven
EngineLoop: the scheduler's batching, chunked prefill and prefix cache over an executor) and transformers'
full recompute (no KV cache: one forward over the whole prefix at every step, its last position's argmax)
judges every generated token.

    oracle = FullRecompute(hf_model(path))
    engine = new_engine(executor, tokenizer, budget=16)           # steps of <= 16 tokens: chunked prefill
    runs = run_greedy(engine, prompts, 48)                        # every prompt at once: batched steps
    tol = tie_tolerance(executor, oracle, runs)                   # measured float32 noise of the gap of two tokens
    verdicts = [judge(oracle, run, tol) for run in runs]
    assert not [f for v in verdicts for f in v.failures()]

Per generated token t (prefix = prompt + the engine's tokens before t):
  * a flip (the engine's token is not transformers' argmax on the prefix) is a tie, not a failure, where
    transformers' own logprob gap between its best token and the engine's is inside the tie tolerance. The
    comparison then goes on along the engine's tokens (transformers re-scores every prefix the engine made:
    the engine's state is exact for its own tokens, so each later step is as well defined as the first);
  * a mismatch (a flip outside the tolerance, or the logprob) at a step whose forward made a discrete choice
    that float32 noise could tip (`Probe`: e.g. an index top-k at a near tie, at any position of the prefix)
    is excused and ends the comparison of that run: the engine may have taken the other branch, which every
    later forward recomputes, so no later step can be judged. Where the engine agrees, the comparison goes on;
  * the engine's logprob of its token must match transformers' on the same prefix (max_dlogprob).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import numpy as np

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.loop_options import options_within
from engine.events import Error, Rejected, Scheduled, Token
from engine.request import GenerateRequest, SamplingParams
from harness.free_running_models import hf_autocast
from harness.models import engine_logits, log_softmax

TOP = 20                    # transformers' best tokens kept per step
MAX_DLOGPROB = 1e-3        # |engine - transformers| logprob of a generated token
MAX_TIE_TOL = 1e-3          # a measured tie tolerance above this fails the gate (a wrong engine can't widen it)


# ---- the engine, free-running -------------------------------------------------------------------------------
@dataclass
class Run:
    """One request's greedy output through the engine."""
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)      # the engine's logprob of each of its tokens
    cached_tokens: int = 0
    refusal: str | None = None                                # the engine's Error or Rejected event, if any

    def sink(self, event) -> None:
        if isinstance(event, (Error, Rejected)):            # (an exception here the engine would swallow)
            self.refusal = repr(event)
        elif isinstance(event, Scheduled):
            self.cached_tokens = event.cached_tokens
        elif isinstance(event, Token):
            self.tokens.append(event.token_id)
            self.logprobs.append(event.logprob)


class _SmallerPool:
    """`executor` as an engine sees it with only its first `blocks` KV blocks (the rest stay unused)."""

    def __init__(self, executor, blocks: int):
        self._executor, self.num_kv_blocks = executor, min(blocks, executor.num_kv_blocks)

    def __getattr__(self, name: str):
        return getattr(self._executor, name)


def new_engine(executor, tokenizer, budget: int | None = None, kv_blocks: int | None = None,
               host_kv_blocks: int = 0, speculative_config=None) -> EngineLoop:
    """A hand-driven EngineLoop over executor (prefix caching and chunked prefill on); budget: tokens a step
    (max_num_batched_tokens; a prompt longer than what a step leaves is prefilled in chunks); kv_blocks: the
    engine sees only that many blocks of the executor's KV pool (a small pool preempts); host_kv_blocks: the
    host KV tier's slots (the executor built with as many); speculative_config: speculative decoding's
    (engine/speculative.py; None: off)."""
    opts = executor.options
    budget = budget or opts.max_num_batched_tokens
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=min(opts.max_num_seqs, budget),
                          host_kv_blocks=host_kv_blocks, speculative_config=speculative_config)
    executor = _SmallerPool(executor, kv_blocks) if kv_blocks else executor
    return EngineLoop(executor, tokenizer, options_within(opts, config, opts.max_model_len), eos_token_ids=[])


def run_greedy(engine: EngineLoop, prompts: list[list[int]], max_tokens: int) -> list[Run]:
    """Submit every prompt at once, step the engine until all are done; max_tokens greedy tokens each."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    runs = [Run(list(p)) for p in prompts]
    for run in runs:
        engine.add_request(GenerateRequest(f"r{id(run)}", list(run.prompt), params), run.sink)
    engine.drain_inbox()
    for _ in range(100000):
        if not engine.has_work():
            break
        engine.step()
        engine.drain_inbox()
    refused = [r.refusal for r in runs if r.refusal]
    if refused:
        raise AssertionError(f"the engine refused or failed a request: {refused}")
    bad = [len(r.tokens) for r in runs if len(r.tokens) != max_tokens]
    if engine.has_work() or bad:
        raise AssertionError(f"the engine did not finish: {bad} tokens of {max_tokens}")
    engine.block_manager.check_invariants(idle=True)
    return runs


# ---- transformers, full recompute -----------------------------------------------------------------------------
Probe = Callable[[], ContextManager[list]]
"""A probe is entered around every oracle forward and yields a list: the forward appends (query position,
description) for each discrete choice it made that float32 noise could tip (empty: every choice robust)."""


def no_probe() -> ContextManager[list]:
    return contextlib.nullcontext([])


@dataclass(frozen=True)
class OracleStep:
    """transformers on one prefix: its best tokens and their logprobs (best first), and the choices of its
    forward that float32 noise could tip (the probe's descriptions)."""
    ids: np.ndarray
    logprobs: np.ndarray
    fragile: tuple[str, ...] = ()
    every: np.ndarray | None = None     # the logprobs of every token (None: only the best TOP are known)

    def gap_to(self, token: int) -> float:
        """Logprob of the best token minus token's (inf when token's is not known: not among the best TOP and
        no full row kept)."""
        hit = np.flatnonzero(self.ids == token)
        if hit.size:
            return float(self.logprobs[0] - self.logprobs[hit[0]])
        return float(self.logprobs[0] - self.every[token]) if self.every is not None else float("inf")


def _step_of(logits: np.ndarray, fragile) -> OracleStep:
    lp = log_softmax(logits[None])[0]
    best = np.argpartition(-lp, TOP)[:TOP]
    ids = best[np.argsort(-lp[best], kind="stable")]
    return OracleStep(ids, lp[ids], tuple(text for _, text in fragile), lp.astype(np.float32))


class FullRecompute:
    """transformers' next token by full recompute: one forward over the whole prefix, no cache (memoized by
    prefix, so every engine path that makes the same tokens shares the work)."""

    def __init__(self, model, probe: Probe = no_probe):
        self.model, self.probe = model, probe
        self._memo: dict[tuple[int, ...], OracleStep] = {}

    def logits(self, ids: list[int], keep: int = 0) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """float32 logits of the last `keep` positions (0: all) of one forward over ids, and its fragile choices."""
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)            # a tiny model's ops: threads only add their synchronization
        try:
            with torch.no_grad(), hf_autocast(self.model), self.probe() as fragile:
                ids = torch.tensor([ids], device=next(self.model.parameters()).device)
                out = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        finally:
            torch.set_num_threads(threads)
        return out.logits[0].float().cpu().numpy(), list(fragile)

    def step(self, prefix: list[int]) -> OracleStep:
        """transformers' next token after prefix: one forward over it (its last position)."""
        key = tuple(prefix)
        if key not in self._memo:
            logits, fragile = self.logits(list(prefix), 1)
            self._memo[key] = _step_of(logits[-1], fragile)
        return self._memo[key]

    def along(self, seq: list[int], start: int, check_every: int = 12, atol: float = 1e-5) -> None:
        """Every step of prefixes seq[:start] .. seq from one forward over seq, memoized: the same as one forward
        per prefix for a causal model. It is checked, not assumed: every check_every-th prefix and the first
        and last are recomputed alone, and their logprobs must agree to atol."""
        logits, fragile = self.logits(seq, len(seq) - start + 1)
        steps = {n: _step_of(row, [f for f in fragile if f[0] < n]) for n, row in zip(range(start, len(seq) + 1), logits)}
        for n in sorted({start, len(seq), *range(start, len(seq) + 1, check_every)}):
            alone = self.step(seq[:n])
            if not np.allclose(alone.logprobs, steps[n].logprobs, rtol=0, atol=atol) or \
                    not np.array_equal(alone.ids[:1], steps[n].ids[:1]):
                raise AssertionError(f"transformers is not causal here: one forward over {len(seq)} tokens and "
                                     f"one over its first {n} disagree at position {n - 1}")
        for n, step in steps.items():
            self._memo.setdefault(tuple(seq[:n]), step)


def tie_tolerance(executor, oracle: FullRecompute, runs: list[Run]) -> float:
    """The float32 tie tolerance, measured: over the runs' sequences fed teacher-forced to both sides (one prefill
    through the executor, one forward of transformers), the most the engine's rounding moves the logprob gap
    of any two tokens at the positions that chose the generated tokens; twice that, a margin for the rounding
    of the engine's other step shapes (decode, chunks)."""
    worst = 0.0
    for run in runs:
        seq, start = run.prompt + run.tokens[:-1], len(run.prompt) - 1
        engine = engine_logits(executor, [seq])[0][start:]
        d = log_softmax(engine).astype(np.float64) - log_softmax(oracle.logits(seq, len(seq) - start)[0])
        worst = max(worst, float((d.max(-1) - d.min(-1)).max()))
    return 2 * worst


# ---- the verdict ------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """One run against the oracle, step by step. ties / flips: (step, transformers' gap between its best token
    and the engine's); stopped: the step where a fragile choice ended the comparison (None: every step)."""
    prompt_len: int
    tie_tol: float
    compared: int = 0
    ties: list[tuple[int, float]] = field(default_factory=list)
    flips: list[tuple[int, float]] = field(default_factory=list)
    bound: float = MAX_DLOGPROB
    max_dlogprob: float = 0.0
    dlogprobs: list[float] = field(default_factory=list)      # |engine - transformers| logprob of each token judged
    stopped: tuple[int, tuple[str, ...]] | None = None

    def failures(self) -> list[str]:
        where = f"prompt of {self.prompt_len} tokens"
        out = [f"{where}: token {t} is not transformers' greedy one (gap {g:.3g} > tie tolerance {self.tie_tol:.3g})"
               for t, g in self.flips]
        if not self.max_dlogprob <= self.bound:
            out.append(f"{where}: |engine - transformers| logprob of a generated token {self.max_dlogprob:.3g}")
        if not self.tie_tol <= MAX_TIE_TOL:
            out.append(f"{where}: measured tie tolerance {self.tie_tol:.3g} > {MAX_TIE_TOL:g}")
        return out


def judge(oracle: FullRecompute, run: Run, tie_tol: float, max_dlogprob: float = MAX_DLOGPROB) -> Verdict:
    """Every generated token of run against transformers' full recompute on the same prefix."""
    v = Verdict(len(run.prompt), tie_tol, bound=max_dlogprob)
    for t, (token, engine_lp) in enumerate(zip(run.tokens, run.logprobs)):
        step = oracle.step(run.prompt + run.tokens[:t])
        gap = step.gap_to(token)
        dlogprob = abs(engine_lp - (step.logprobs[0] - gap))
        if step.fragile and (gap > tie_tol or not dlogprob <= max_dlogprob):
            v.stopped = (t, step.fragile)
            break
        if gap > 0:
            (v.ties if gap <= tie_tol else v.flips).append((t, gap))
        v.max_dlogprob = max(v.max_dlogprob, dlogprob)
        v.dlogprobs.append(dlogprob)
        v.compared += 1
    return v
