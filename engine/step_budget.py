"""What one engine step may hold: max_num_batched_tokens tokens (vLLM's budget; the executor is built
for no more), and, where the executor has a cost model (StepCost: the CPU executor's), as much work.

On the GPU a step's time follows its tokens, so the token budget alone bounds it (no StepCost). On the
CPU a token's attention also costs: every sequence of the step reads the K and V of its whole context,
and a prefill chunk scores each of its tokens against every key. StepCost counts both in tokens'
worth of the linear layers, so a chunk late in a long prompt, or a decode of a long sequence, weighs
more than one token; the scheduler cuts prefill chunks to what the work budget leaves. Decodes are never
cut (each running sequence still takes its one token, as with the token budget alone), and the step's
first prefill chunk gets at least MIN_PREFILL tokens, so every prompt progresses whatever the decodes
take. Four, not one: late in a long prompt a step's read of the prompt's own context is most of its cost
(8k tokens of SmolLM2 on the CPU: ~23 tokens' worth). With SmolLM2's CPU cost model and defaults, 8 streams
decoding, then an 8,101-token prompt (tests/engine/test_step_budget.py's run), a step late in the prompt holds the
decodes and a chunk of ~7 tokens: at 0.13 s + 3.5 ms a token's worth, ~0.47 s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_PREFILL = 4


@dataclass(frozen=True)
class StepCost:
    """A sequence's share of a step, in tokens' worth of work: feeding n tokens after `start` computed
    ones (so its context is start + n keys) costs n + context * key + n * context * pair. min_work: the
    work a step may hold even where max_num_batched_tokens tokens' worth is less (a small model's tokens
    cost little: its steps are not cut finer than a larger model's of the same time)."""
    key: float                  # one key of the context read (its K and V, every layer)
    pair: float                 # one (new token, key) pair scored (every head, every layer)
    min_work: float = 0.0

    def of(self, start: int, n: int) -> float:
        context = start + n
        return n + context * self.key + n * context * self.pair

    def most_within(self, work: float, start: int, n: int) -> int:
        """The most tokens m <= n fed after `start` whose cost is at most `work` (0 if none)."""
        if n <= 0 or self.of(start, 1) > work:
            return 0
        if self.of(start, n) <= work:
            return n
        # cost(m) = pair·m² + (1 + key + start·pair)·m + start·key, increasing in m: its root at `work`
        a, b, c = self.pair, 1 + self.key + start * self.pair, start * self.key - work
        m = int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)) if a > 0 else int(-c / b)
        m = max(1, min(m, n))
        while m > 1 and self.of(start, m) > work:       # float rounding at the boundary
            m -= 1
        while m < n and self.of(start, m + 1) <= work:
            m += 1
        return m


@dataclass
class StepBudget:
    """What is left of one step: tokens (hard) and work (token-equivalents under `cost`; None: tokens
    alone bound the step). `prefilled`: a prefill chunk was taken (the progress guarantee is spent)."""
    tokens: int
    work: float
    cost: StepCost | None = None
    prefilled: bool = False

    @classmethod
    def of(cls, max_num_batched_tokens: int, cost: StepCost | None) -> "StepBudget":
        work = max(max_num_batched_tokens, cost.min_work) if cost is not None else max_num_batched_tokens
        return cls(max_num_batched_tokens, float(work), cost)

    def fit(self, start: int, want: int, least: int = MIN_PREFILL) -> int:
        """How many of `want` new tokens, fed after `start` computed ones, this step can take: all the
        tokens left for a decode (want 1); a prefill chunk cut to the work left, but, for the step's
        first, at least `least`."""
        n = min(want, self.tokens)
        if self.cost is None or n <= 1:
            return max(n, 0)
        m = self.cost.most_within(self.work, start, n)
        return m if self.prefilled else max(m, min(n, least))

    def fit_verify(self, start: int, drafts: int, reserve: int) -> int:
        """A decode with drafts (speculative decoding), fed after `start` computed tokens: its token and as many
        drafts as the step leaves: tokens less `reserve` (kept for what follows), and work (the drafts are cut
        to it; the decode, as any decode, never is)."""
        n = max(min(1 + drafts, self.tokens - reserve), 1)
        if self.cost is not None and n > 1:
            n = max(self.cost.most_within(self.work, start, n), 1)
        return n

    def spend(self, start: int, n: int, prefill: bool) -> None:
        """Account n tokens fed after `start` computed ones (prefill: part of a prompt, or a recompute)."""
        self.tokens -= n
        if self.cost is not None:
            self.work -= self.cost.of(start, n)
        self.prefilled |= prefill
