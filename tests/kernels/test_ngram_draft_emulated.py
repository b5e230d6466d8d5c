"""ngram_draft.cu on the host, without a GPU (tests/cuda_emulation.h, as test_deltanet_kernels_emulated): the
device drafts equal engine/ngram.py ngram_draft (vLLM's prompt lookup) on random and adversarial sequences
(one repeated id, periods, ties between equal matches in other threads and warps, matches reaching the row's
start, sequences shorter than min_n, rows longer than the CTA, every k and limit), with the sequences in rows of
a shared buffer in scrambled order; ngram_append writes each sequence's emitted ids (spec_accept.cu's layout)
after its ids. What the emulation cannot see (speed, occupancy) is for tests/gpu/test_gpu_ngram.py."""
from __future__ import annotations

import numpy as np
from test_decode_kernels_emulated import run
from test_deltanet_kernels_emulated import host

from engine.ngram import ngram_draft

THREADS = 256          # ngram_draft.cu NGRAM_THREADS


def adversarial(rng: np.random.Generator, length: int) -> np.ndarray:
    """A sequence drawn to repeat: one id, a short period with a tail, few ids, or a block copied earlier."""
    kind = rng.integers(5)
    if kind == 0:
        return np.full(length, rng.integers(3), np.int32)
    if kind == 1:
        period = rng.integers(1, 6)
        base = np.resize(rng.integers(0, 50, period), length)
        base[rng.integers(length):] = rng.integers(0, 50)      # a tail that breaks the period at some point
        return base.astype(np.int32)
    if kind == 2:
        return rng.integers(0, rng.choice([2, 3, 4, 50_000]), length).astype(np.int32)
    seq = rng.integers(0, 8, length).astype(np.int32)
    n = int(rng.integers(1, 9))
    if length > 2 * n:                             # the suffix copied to 1..3 earlier places
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, length - 2 * n + 1))
            seq[at:at + n] = seq[length - n:]
    return seq


def check_drafts(seqs: list[np.ndarray], min_n: int, max_n: int, k: int, limits: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    stride = max(len(s) for s in seqs) + int(rng.integers(0, 5))
    rows = rng.permutation(len(seqs) + 2)[:len(seqs)].astype(np.int32)      # rows in scrambled order, some unused
    tokens = rng.integers(-5, 100, (len(seqs) + 2, stride)).astype(np.int32)   # junk past every length
    for s, r in zip(seqs, rows):
        tokens[r, :len(s)] = s
    drafts, counts = host(np.full((len(seqs), k), -9, np.int32)), host(np.full(len(seqs), -9, np.int32))
    run("ngram_draft", "ngram_draft", (len(seqs),), THREADS,
        (host(tokens), np.int64(stride), host(rows), host(np.array([len(s) for s in seqs], np.int32)),
         host(np.array(limits, np.int32)), np.int32(min_n), np.int32(max_n), np.int32(k), drafts, counts))
    for b, (s, limit) in enumerate(zip(seqs, limits)):
        want = ngram_draft(s.astype(np.int64), min_n, max_n, min(limit, k))
        got = drafts[b, :counts[b]].tolist()
        assert got == want, (b, s.tolist(), min_n, max_n, limit)


def test_documented_cases():
    """engine/ngram.py's documented cases (tests/spec/test_spec_ngram.py), one launch per n range."""
    cases = [([1, 2, 3, 4, 2, 3], 2, 3, 4), ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2), ([1, 2, 3, 4, 1, 2, 3], 1, 3, 10),
             ([1, 2, 1, 2, 1, 2], 2, 2, 3), ([5, 1, 9, 1], 1, 1, 3), ([1, 2, 3], 1, 3, 2), ([7], 1, 1, 2),
             ([3, 3], 1, 1, 4), ([1, 2, 3, 1, 2], 3, 4, 2), ([4, 5, 6, 4, 5, 6, 4, 5], 1, 2, 0)]
    for i, (tokens, min_n, max_n, limit) in enumerate(cases):
        check_drafts([np.array(tokens, np.int32)], min_n, max_n, 10, [limit], seed=i)


def test_random_and_adversarial_sequences():
    """Many sequences a launch, lengths from 1 to past two CTA widths (matches in every thread and warp, ties
    between them), every n range to 8 and limits from 0 past k."""
    rng = np.random.default_rng(56)
    for trial in range(12):
        min_n = int(rng.integers(1, 5))
        max_n = int(rng.integers(min_n, 9))
        k = int(rng.integers(1, 9))
        seqs = []
        for _ in range(24):
            length = int(rng.choice([rng.integers(1, 12), rng.integers(12, 200), rng.integers(200, 3 * THREADS)]))
            seqs.append(adversarial(rng, length))
        limits = [int(v) for v in rng.integers(0, k + 3, len(seqs))]
        check_drafts(seqs, min_n, max_n, k, limits, seed=trial)


def test_the_earliest_of_equal_matches_across_threads():
    """The same n-gram ending at positions whose threads' order differs from theirs (p = 302 is thread 46, p = 5
    thread 5, p = 702 thread 190), or that one thread visits in turn (p = 10, 266, 522: thread 10): the earliest
    wins, whichever thread found it, with a different continuation after each."""
    for places in ((300, 3, 700), (520, 264, 8)):
        seq = np.arange(1000, 1800, dtype=np.int32)
        suffix = np.array([7, 8, 9], np.int32)
        for at in places:
            seq[at:at + 3] = suffix
        seq = np.concatenate([seq, suffix])
        check_drafts([seq, seq[:-1], seq[4:]], 1, 3, 5, [5, 5, 5], seed=1)


def test_append_writes_each_sequences_emitted_ids():
    """ngram_append over spec_accept.cu's layout: sequence b's rows from row_start[b], its accepted count; the
    accepted ids and the one after them land at its row's position at[b], the rows' other ids untouched, its
    new length in lengths[b]; a row's end clips them; a sequence without a row (-1) is skipped."""
    rng = np.random.default_rng(3)
    stride, B = 40, 5
    tokens = rng.integers(0, 100, (B + 1, stride)).astype(np.int32)
    want = tokens.copy()
    rows = np.array([4, 0, -1, 5, 1], np.int32)
    at = np.array([3, 10, 0, 38, 20], np.int32)
    per_seq = np.array([5, 1, 3, 4, 2])
    row_start = np.concatenate([[0], np.cumsum(per_seq)]).astype(np.int32)
    accepted = np.array([2, 0, 2, 3, 1], np.int32)
    ids = rng.integers(100, 200, int(row_start[-1])).astype(np.int32)
    lengths = host(np.full(B, -9, np.int32))
    run("ngram_draft", "ngram_append", (1,), 128,
        (host(tokens), np.int64(stride), host(rows), host(at), host(ids), host(row_start), host(accepted),
         np.int32(B), lengths))
    want_lengths = np.full(B, -9, np.int32)
    for b in np.flatnonzero(rows >= 0):
        n = min(accepted[b] + 1, stride - at[b])
        want[rows[b], at[b]:at[b] + n] = ids[row_start[b]:row_start[b] + n]
        want_lengths[b] = at[b] + n
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, want_lengths)
