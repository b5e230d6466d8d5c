"""DeepSeek-V4's lightning indexer in the transformers oracle: one rule for equal scores, and a probe of the
choices float32 noise could tip (harness/free_running_oracle.py's Probe).

The indexer keeps each query's `index_topk` best compressed entries by score = sum over its heads of
weight · relu(q · k). Entries whose every head's q · k is negative all score exactly 0, so equal scores at the
top-k's edge are common (with 2 index heads about a quarter of the entries), and which of them torch.topk
keeps is unspecified: transformers' no-cache forward over a sequence and over its prefix keep different ones
(tests/models/test_free_running_dsv4.py shows it), so its full recompute is no oracle there. `index_tie_rule` makes
the choice the one the engine makes (cpu_dsv4_attention.indexer_pick): among equal scores the lower entry
index first. It changes nothing where the scores at the edge differ.

Under the rule, `index_tie_rule` also reports the queries whose kept set float32 noise could change: each
head's q · k may be off by `rel` · |q| · |k| (and the weighted sum by `rel` of its size); a query's choice is
robust where every kept entry's lowest score beats every dropped entry's highest, or where the edge is
entries that score exactly 0 whatever the noise (their order is then the rule's on both sides).
"""
from __future__ import annotations

import contextlib

REL_NOISE = 1e-5          # float32 noise of a dot product, relative to |q|·|k| (the engine vs transformers: ~1e-6)


@contextlib.contextmanager
def index_tie_rule(rel: float = REL_NOISE):
    """Within: transformers' DeepSeek-V4 indexer keeps, among equal scores, the lower entry index first; yields
    the list the fragile choices are appended to: (query position, description)."""
    import torch
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as hf

    fragile: list[tuple[int, str]] = []
    bounds: list = []
    scorer_forward, indexer_forward, topk = (hf.DeepseekV4IndexerScorer.forward, hf.DeepseekV4Indexer.forward,
                                             torch.Tensor.topk)

    def scorer(self, q, compressed_kv, hidden_states):
        scores = scorer_forward(self, q, compressed_kv, hidden_states)
        bounds.append(score_bounds(self, q, compressed_kv, hidden_states, rel))
        return scores

    def stable_topk(scores, k, dim=-1, largest=True, sorted=True):
        values, order = torch.sort(scores + 0.0, dim=dim, descending=largest, stable=True)   # -0.0 == 0.0
        kept = order.narrow(dim, 0, k)
        if bounds and scores.dim() == 3:
            fragile.extend(robustness(scores, kept, *bounds.pop()))
        return torch.return_types.topk((values.narrow(dim, 0, k), kept))

    def indexer(self, *args, **kwargs):
        torch.Tensor.topk = stable_topk
        try:
            return indexer_forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = topk
            bounds.clear()

    hf.DeepseekV4IndexerScorer.forward, hf.DeepseekV4Indexer.forward = scorer, indexer
    try:
        yield fragile
    finally:
        hf.DeepseekV4IndexerScorer.forward, hf.DeepseekV4Indexer.forward = scorer_forward, indexer_forward


def score_bounds(scorer, q, compressed_kv, hidden_states, rel: float):
    """(lowest, highest) score [B, S, T] of each query and entry when each head's q · k moves by rel·|q|·|k|."""
    import torch
    q, k = q.float(), compressed_kv.float()
    dots = torch.einsum("bshd,btd->bsht", q, k)
    eps = rel * q.norm(dim=-1)[..., None] * k.norm(dim=-1)[:, None, None, :]
    w = (scorer.weights_proj(hidden_states).float() * scorer.weights_scaling)[..., None] * scorer.softmax_scale
    ends = torch.stack([w * torch.relu(dots - eps), w * torch.relu(dots + eps)])   # each term is monotone in q·k
    size = rel * ends.abs().amax(0).sum(2)
    return ends.amin(0).sum(2) - size, ends.amax(0).sum(2) + size


def robustness(scores, kept, low, high) -> list[tuple[int, str]]:
    """(position, description) of each query whose kept set (indices [B, S, k] of the masked scores [B, S, T]) may
    not stand under the noise (none: every choice robust)."""
    import torch
    if not scores.shape[-1]:
        return []
    closed = torch.isfinite(scores)
    chosen = torch.zeros_like(closed).scatter_(-1, kept, True) & closed
    dropped = closed & ~chosen
    low_kept = torch.where(chosen, low, torch.inf).amin(-1)
    high_dropped = torch.where(dropped, high, -torch.inf).amax(-1)
    exact_zero = (low == 0) & (high == 0)
    straddles = closed & (low <= 0) & (high >= 0)
    zero_edge = (low_kept == 0) & (high_dropped == 0) & ~(straddles & ~exact_zero).any(-1)
    weak = ~((low_kept > high_dropped) | zero_edge | ~dropped.any(-1))
    return [(int(s), f"index top-{kept.shape[-1]} of query {int(s)}: kept entries score down to "
                     f"{float(low_kept[b, s]):.3g}, a dropped one up to {float(high_dropped[b, s]):.3g}")
            for b, s in weak.nonzero().tolist()]
