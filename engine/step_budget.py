"""What one engine step may hold: max_num_batched_tokens tokens (vLLM's budget; the executor is built
for no more), and, where the executor has a cost model (StepCost: the CPU executor's), as much time.

On the GPU a step's time follows its tokens, so the token budget alone bounds it (no StepCost). On the
CPU it does not: the linear layers cost a matrix-vector product's read of the weights at one row and a
slower matrix product's (BLAS packs the weights) from two rows on, plus each row's multiply-adds; and
every sequence of the step reads the K and V of its whole context, and a prefill chunk scores each of its
tokens against every key. StepCost models a step's seconds from those terms, and the scheduler cuts
prefill chunks to what the step's time budget leaves. Decodes are never cut (each running sequence still
takes its one token, as with the token budget alone), and the step's first prefill chunk gets at least
MIN_PREFILL tokens, so every prompt progresses whatever the decodes take. Four, not one: late in a long
prompt a step's read of the prompt's own context is most of its cost. With SmolLM2's CPU cost model and
defaults, 8 streams decoding, then an 8,101-token prompt (tests/engine/test_step_budget.py's run), a step late in
the prompt holds the decodes and MIN_PREFILL's 4 tokens, modelled at ~0.38 s (the CPU's target: 0.35 s).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_PREFILL = 4


@dataclass(frozen=True)
class Products:
    """Seconds of a set of matrix products (a model's decoder layers, or its lm_head) over `rows` rows:
    at one row, matrix-vector products reading the weights (`one`); at more, matrix products: their read
    of the weights (`many`) and each row's multiply-adds (`row`)."""
    one: float
    many: float
    row: float

    def __post_init__(self) -> None:
        if not 0 <= self.one <= self.many + 2 * self.row or min(self.many, self.row) < 0:
            raise ValueError(f"{self}: the time must not fall from one row to two, nor be negative")

    def of(self, rows: int) -> float:
        return 0.0 if rows <= 0 else self.one if rows == 1 else self.many + rows * self.row


@dataclass(frozen=True)
class StepCost:
    """A step's modelled time, seconds: its fixed part (`base`: the calls of its embedding, norms,
    sampling), the decoder layers' products over all its rows, the lm_head's over the rows it samples
    (one a sequence, every row of a verify), and each sequence's own part (own()). target: the time a
    step aims at."""
    base: float
    layers: Products
    head: Products
    seq: float                  # a sequence's fixed share (its attention's calls, every layer)
    key: float                  # one key of its context read (its K and V, every layer)
    pair: float                 # one (new token, key) pair scored (every head, every layer)
    target: float

    def own(self, start: int, n: int) -> float:
        """A sequence's own part of a step feeding n tokens after `start` computed ones (its context is
        start + n keys)."""
        context = start + n
        return self.seq + context * self.key + n * context * self.pair

    def time(self, rows: int, sampled: int, own: float) -> float:
        """A step of `rows` rows sampling `sampled`, its sequences' own parts summing to `own`."""
        return self.base + self.layers.of(rows) + self.head.of(sampled) + own


@dataclass
class StepBudget:
    """What is left of one step: tokens (hard) and time (under `cost`; None: tokens alone bound the
    step). limit: the time a step may take: the cost's target or, where more, the linear layers' time
    at the step's tokens (a larger token budget asked for is kept, as tokens' worth of work). rows,
    sampled, own: what the step holds so far. prefilled: a prefill chunk was taken (the progress
    guarantee is spent)."""
    tokens: int
    cost: StepCost | None = None
    limit: float = math.inf
    rows: int = 0
    sampled: int = 0
    own: float = 0.0
    prefilled: bool = False

    @classmethod
    def of(cls, max_num_batched_tokens: int, cost: StepCost | None) -> StepBudget:
        if cost is None:
            return cls(max_num_batched_tokens)
        tokens = cost.base + cost.layers.of(max_num_batched_tokens) + cost.head.of(1)
        return cls(max_num_batched_tokens, cost, max(cost.target, tokens))

    def time(self) -> float:
        """The modelled seconds of what the step holds (0 without a cost model)."""
        return self.cost.time(self.rows, self.sampled, self.own) if self.cost is not None else 0.0

    def _time_with(self, start: int, n: int, sampled: int) -> float:
        return self.cost.time(self.rows + n, self.sampled + sampled, self.own + self.cost.own(start, n))

    def most_within(self, start: int, n: int, verify: bool = False) -> int:
        """The most tokens m <= n fed after `start` (each sampled where `verify`, else one row) that keep
        the step within its limit (0 if none): the step's time grows with m, so a bisection finds it."""
        def fits(m: int) -> bool:
            return self._time_with(start, m, m if verify else 1) <= self.limit

        if n <= 0 or not fits(1):
            return 0
        lo, hi = 1, n                       # fits(lo); the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def fit(self, start: int, want: int, least: int = MIN_PREFILL) -> int:
        """How many of `want` new tokens, fed after `start` computed ones, this step can take: all the
        tokens left for a decode (want 1); a prefill chunk cut to the time left, but, for the step's
        first, at least `least`."""
        n = min(want, self.tokens)
        if self.cost is None or n <= 1:
            return max(n, 0)
        m = self.most_within(start, n)
        return m if self.prefilled else max(m, min(n, least))

    def fit_verify(self, start: int, drafts: int, reserve: int) -> int:
        """A decode with drafts (speculative decoding), fed after `start` computed tokens: its token and as many
        drafts as the step leaves: tokens less `reserve` (kept for what follows), and time (the drafts are cut
        to it; the decode, as any decode, never is)."""
        n = max(min(1 + drafts, self.tokens - reserve), 1)
        if self.cost is not None and n > 1:
            n = max(self.most_within(start, n, verify=True), 1)
        return n

    def spend(self, start: int, n: int, prefill: bool) -> None:
        """Account n tokens fed after `start` computed ones (prefill: part of a prompt, or a recompute,
        sampling at most one row; else a decode, every row sampled)."""
        self.tokens -= n
        if self.cost is not None:
            self.rows += n
            self.sampled += 1 if prefill else n
            self.own += self.cost.own(start, n)
        self.prefilled |= prefill
