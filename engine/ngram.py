"""Draft proposers: what speculative decoding asks of one (DraftProposer), and vLLM's `ngram` method.

Prompt lookup (vLLM's NgramProposer): of a sequence's tokens so far (prompt and output), take the longest
suffix n-gram, prompt_lookup_min <= n <= prompt_lookup_max, that also occurs earlier in them; of its earlier
occurrences the first (the earliest in the sequence); the draft is the (at most k) tokens that followed it
there. No n-gram found: no draft. This one runs on the host over numpy arrays, O(length) per sequence; a
device proposer (the sequences' ids kept on the GPU, no host round trip per step) implements the same
protocol's semantics.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.sequence import Sequence


class DraftProposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Draft tokens to follow each sequence's token_ids: at most limits[i] (>= 1) for seqs[i], fewer or
        none where it has no better guess."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [ngram_draft(np.asarray(s.token_ids, np.int64), self.min_n, self.max_n, k)
                for s, k in zip(seqs, limits)]


def ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens after the earliest earlier occurrence of the longest suffix n-gram of `tokens` with
    min_n <= n <= max_n (fewer where the sequence ends sooner); [] if there is none."""
    last = len(tokens) - 1
    if k <= 0 or last < min_n:                # an n-gram and an earlier occurrence need n + 1 tokens
        return []
    ends = np.flatnonzero(tokens[:last] == tokens[last])     # where an earlier 1-gram match ends
    n = 1
    while ends.size and n < max_n:            # grow the match while some occurrence still extends
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[last - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    start = int(ends[0]) + 1                  # ends ascending: the earliest occurrence of the n-gram
    return tokens[start:start + k].tolist()
