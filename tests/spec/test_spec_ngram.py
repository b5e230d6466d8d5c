"""The n-gram (prompt lookup) proposer against its definition (vLLM's NgramProposer): the longest suffix n-gram,
min <= n <= max, found earlier in the sequence; its earliest occurrence; the (at most k) tokens after it."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.ngram import NgramProposer, ngram_draft
from engine.request import SamplingParams
from engine.sequence import Sequence


def oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, by brute force: for n from max_n down to min_n, the first start i < len - n whose
    n tokens equal the last n; the draft is what follows that occurrence."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n:]
        for i in range(L - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


@pytest.mark.parametrize("tokens,min_n,max_n,k,want", [
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),          # vLLM's docstring: [2, 3] matched, 3 tokens follow
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 10, [4, 1, 2, 3]),   # the longest (3) wins over shorter, later ones
    ([1, 2, 1, 2, 1, 2], 2, 2, 3, [1, 2, 1]),          # the earliest occurrence, even overlapping the suffix
    ([5, 1, 9, 1], 1, 1, 3, [9, 1]),
    ([1, 2, 3], 1, 3, 2, []),                          # nothing repeats
    ([7], 1, 1, 2, []),
    ([3, 3], 1, 1, 4, [3]),
    ([1, 2, 3, 1, 2], 3, 4, 2, []),                    # only a 2-gram repeats: below min
    ([4, 5, 6, 4, 5, 6, 4, 5], 1, 2, 0, []),           # k = 0
])
def test_documented_cases(tokens, min_n, max_n, k, want):
    assert ngram_draft(np.array(tokens), min_n, max_n, k) == want == oracle(tokens, min_n, max_n, k)


def test_matches_the_definition_on_random_sequences():
    rng = random.Random(0)
    for trial in range(3000):
        alphabet = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        min_n = rng.randrange(1, 5)
        max_n = rng.randrange(min_n, 7)
        k = rng.randrange(1, 8)
        got = ngram_draft(np.array(tokens, np.int64), min_n, max_n, k)
        assert got == oracle(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_proposer_reads_each_sequence_and_keeps_its_limit():
    params = SamplingParams(max_tokens=50)
    a = Sequence(1, "a", [9, 1, 2, 3, 1, 2], 6, params)
    b = Sequence(2, "b", [4, 4, 4, 4], 4, params)
    c = Sequence(3, "c", [1, 2, 3], 3, params)
    assert NgramProposer(2, 3).propose([a, b, c], [5, 1, 4]) == [[3, 1, 2], [4], []]
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(3, 2)
