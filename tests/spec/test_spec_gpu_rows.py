"""The GPU verify step's host side, without a GPU: a verify step's rows as the device sampler takes them
(engine/executor/verify_rows.py), each sampled as engine/sampling.py samples a row and accepted by the same rule
as spec_accept.cu, emits exactly what engine/sampling.py verify_seq (the numpy executor's verification) emits —
tokens, accepted drafts, logprobs — for greedy, seeded sampling, penalties, min_tokens, logit_bias and a grammar
that completes inside the drafts; spec_accept.cu run on the host (tests/cuda_emulation.h) against
accepted_counts; GpuVerify and the read-back over host memory (CuPy replaced): the accepted counts before the
rows' ids, assembled into SampledTokens, in the eager and a verify graph's padded layout; the sampled rows the
executor is sized for."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.gpu_readback import ReadbackStep
from engine.executor.gpu_verify import VerifiedStep
from engine.executor.verify_rows import accepted_counts, verify_rows
from engine.grammar import allowed_tokens
from engine.request import SamplingParams
from engine.sampling import sample_row, verify_seq

V = 64
K_PAD = 5                      # a padded verify graph's rows per sequence (k = 4)
PARAMS = {
    "greedy": SamplingParams(temperature=0),
    "greedy-logprobs": SamplingParams(temperature=0, logprobs=3),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=7, logprobs=1),
    "sampled-top-k-min-p": SamplingParams(temperature=1.2, top_k=9, min_p=0.05, seed=3),
    "penalties": SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.4, frequency_penalty=0.6,
                                presence_penalty=0.4, logprobs=2),
    "greedy-penalties": SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.9),
    "min-tokens-bias": SamplingParams(temperature=0.9, seed=2, min_tokens=4, stop_token_ids=[1, 2],
                                      logit_bias={5: 3.0, 6: -2.0}),
}


class FakeGrammar:
    """A grammar whose allowed tokens depend on the tokens taken so far (a pseudo-random half of the vocabulary,
    stop tokens 1 and 2 always), complete after `length` tokens: the GrammarMatcher calls verification makes."""

    def __init__(self, length: int, seed: int):
        self.taken: list[int] = []
        self.length, self.seed, self.words = length, seed, V // 32

    def allowed(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, *self.taken])
        out = rng.random(V) < 0.5
        out[[1, 2]] = True
        return out

    def bitmask(self) -> np.ndarray:
        return np.packbits(self.allowed(), bitorder="little").view(np.int32)

    def advance_draft(self, token: int) -> bool:
        ok = bool(self.allowed()[token])
        self.taken.append(token)
        return ok

    def rollback(self, n: int) -> None:
        del self.taken[len(self.taken) - n:]

    @property
    def done(self) -> bool:
        return len(self.taken) >= self.length


def seq_step(params: SamplingParams, k: int, drafts: list[int], grammar=None, seq_id: int = 0) -> SeqStep:
    history = [3, 9, 9, 4, 11, 3, 20, 5]
    return SeqStep(seq_id=seq_id, token_ids=[history[-1]] + drafts, start_pos=len(history) - 1,
                   block_table=[0, 1], sample=True, params=params, prompt_len=5, history=history, num_generated=3,
                   grammar=grammar, num_drafts=len(drafts))


def drafts_for(logits: np.ndarray, params: SamplingParams, k: int, rng: random.Random, grammar=None) -> list[int]:
    """k drafts: each the token its row samples after the drafts before it (what plain decoding would emit),
    replaced by another token the grammar allows with probability 0.35."""
    drafts: list[int] = []
    base = seq_step(params, 0, [])
    for j in range(k):
        allowed = grammar.allowed() if grammar is not None else None
        t = sample_row(logits[j], base, allowed, drafts).token_id
        if rng.random() < 0.35:
            choices = np.flatnonzero(allowed) if allowed is not None else np.arange(V)
            t = int(rng.choice([c for c in choices.tolist() if c != t]))
        drafts.append(t)
        if grammar is not None:
            grammar.advance_draft(t)
    if grammar is not None:
        grammar.rollback(k)
    return drafts


def verify_case(specs, seed: int) -> tuple[list[SeqStep], list[np.ndarray]]:
    """One SeqStep per (PARAMS name, draft count, grammar or None) and its rows' logits; drafts by drafts_for."""
    rng = random.Random(seed)
    steps, logits = [], []
    for i, (name, k, grammar) in enumerate(specs):
        lg = (np.random.default_rng(i).standard_normal((k + 1, V)) * 2).astype(np.float32)
        steps.append(seq_step(PARAMS[name], k, drafts_for(lg, PARAMS[name], k, rng, grammar), grammar, seq_id=i))
        logits.append(lg)
    return steps, logits


def emulated_verify(logits: np.ndarray, steps: list[SeqStep]):
    """The GPU path on the host: the rows of verify_rows, each sampled alone with its own mask, then accepted."""
    rows = verify_rows(steps)
    masks = dict(zip(rows.bitmask[0], rows.bitmask[1])) if rows.bitmask is not None else {}
    tokens = [sample_row(raw, step, allowed_tokens(masks[r], V) if r in masks else None)
              for r, (raw, step) in enumerate(zip(logits, rows.steps))]
    return rows.accept(tokens)


def as_tuple(token):
    return [(t.token_id, t.logprob, t.top_logprobs) for t in token.emitted()]


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("with_grammar", [False, True], ids=["plain", "grammar"])
def test_rows_sampled_alone_emit_what_verify_seq_emits(name, with_grammar):
    params, k = PARAMS[name], 4
    accepted = set()
    for case in range(40):
        rng = random.Random(case)
        logits = (np.random.default_rng(case).standard_normal((k + 1, V)) * 2.5).astype(np.float32)
        grammar = FakeGrammar(length=rng.randrange(1, 7), seed=case) if with_grammar else None
        drafts = drafts_for(logits, params, k, rng, grammar)
        want = verify_seq(logits, seq_step(params, k, drafts, grammar))
        got = emulated_verify(logits, [seq_step(params, k, drafts, grammar)])[0]
        assert as_tuple(got) == as_tuple(want), (case, drafts)
        assert grammar is None or grammar.taken == []          # the drafts given back
        accepted.add(len(want.accepted))
    assert len(accepted) >= 3, accepted                      # short and long acceptances both checked


def test_a_batch_of_verify_and_plain_rows():
    """Sequences with and without drafts in one step: their rows in ModelBatch.sample_rows' order, each
    sequence's tokens verify_seq's."""
    steps, logits_by_seq = verify_case([("greedy", 3, None), ("sampled", 0, None), ("penalties", 2, None),
                                        ("greedy-logprobs", 4, None)], seed=1)
    batch = ModelBatch.build(steps)
    rows = verify_rows(steps)
    assert rows.num_rows == len(batch.sample_rows) == 13
    assert rows.row_start.tolist() == [0, 4, 5, 8, 13]
    got = emulated_verify(np.concatenate(logits_by_seq), steps)
    for token, logits, s in zip(got, logits_by_seq, steps):
        want = verify_seq(logits, s) if s.num_drafts else sample_row(logits[0], s)
        assert as_tuple(token) == as_tuple(want) and token.seq_id == s.seq_id


def test_rows_carry_the_drafts_before_them():
    s = seq_step(PARAMS["penalties"], 3, [7, 8, 9])
    rows = verify_rows([s])
    assert [r.history[len(s.history):] for r in rows.steps] == [[], [7], [7, 8], [7, 8, 9]]
    assert [r.num_generated for r in rows.steps] == [3, 4, 5, 6]
    assert rows.compare.tolist() == [7, 8, 9, -1]
    g = FakeGrammar(length=2, seed=0)
    d = [int(np.flatnonzero(g.allowed())[3])]
    g.advance_draft(d[0])
    d.append(int(np.flatnonzero(g.allowed())[3]))
    g.rollback(1)
    rows = verify_rows([seq_step(PARAMS["greedy"], 2, d, g)])
    assert rows.compare.tolist() == [d[0], -1, -1]           # complete at the second draft: row 1 ends it
    assert rows.bitmask[0] == [0, 1]


def accept_cases():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 6, size=37)
    row_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ids = rng.integers(0, 4, size=int(row_start[-1])).astype(np.int32)
    compare = rng.integers(0, 4, size=ids.size).astype(np.int32)
    compare[row_start[1:] - 1] = -1
    compare[rng.random(ids.size) < 0.1] = -1
    return ids, compare, row_start


def test_accepted_counts():
    ids = np.array([5, 6, 7, 1, 2, 9], np.int32)
    compare = np.array([5, 6, -1, 2, -1, -1], np.int32)
    assert accepted_counts(ids, compare, np.array([0, 3, 5, 6], np.int32)).tolist() == [2, 0, 0]


def test_spec_accept_kernel_on_the_host():
    """spec_accept.cu through the host emulation, with GpuVerify's buffer layout ([compare | row_start] in one
    input buffer, [counts | ids] out): the counts accepted_counts gives, the ids after them."""
    from test_deltanet_kernels_emulated import EmulatedShared, host
    ids, compare, row_start = accept_cases()
    B, S, max_rows = len(row_start) - 1, ids.size, ids.size + 5
    inputs = np.zeros(max_rows + B + 1, np.int32)
    inputs[:S], inputs[max_rows:] = compare, row_start
    out = host(np.full(B + max_rows, -7, np.int32))
    inputs = host(inputs)
    EmulatedShared().launch(("spec_accept", "spec_accept", ()), (-(-B // 16),), (16,),
                            (host(ids), inputs, host(inputs[max_rows:]), np.int32(B), out))
    want = accepted_counts(ids, compare, row_start)
    assert want.max() >= 2 and (want == 0).any()
    np.testing.assert_array_equal(out[:B], want)
    np.testing.assert_array_equal(out[B:B + S], ids)


def test_the_read_back_assembles_accepted_drafts():
    """VerifiedStep over a read-back slot as Readback.queue lays it out: counts [B], then the rows' ids."""
    steps = [seq_step(PARAMS["greedy-logprobs"], 2, [4, 8], seq_id=10), seq_step(PARAMS["greedy-logprobs"], 0, [],
                                                                                   seq_id=11)]
    rows = verify_rows(steps)
    ids_host = np.array([2, 0, 4, 8, 30, 12], np.int32)
    lp = np.array([-0.5, -0.25, -1.0, -2.0], np.float32)
    top_ids = np.arange(4 * 20, dtype=np.int32).reshape(4, 20)
    top_lp = -np.ones((4, 20), np.float32)
    done = SimpleNamespace(synchronize=lambda: None)
    pending = ReadbackStep([s.seq_id for s in rows.steps], ids_host[2:], done, [3] * 4, lp, top_ids, top_lp,
                           ids_host[:2])
    out = VerifiedStep(pending, rows).result().sampled
    assert [[t.token_id for t in s.emitted()] for s in out] == [[4, 8, 30], [12]]
    assert [t.logprob for t in out[0].emitted()] == [-0.5, -0.25, -1.0]
    assert out[0].accepted[1].top_logprobs == [(20, -1.0), (21, -1.0), (22, -1.0)]
    assert [s.seq_id for s in out] == [10, 11]


def test_the_executor_is_sized_for_the_verify_rows():
    from engine.config import EngineConfig
    from engine.executor.gpu_plan import GpuPlan
    from engine.executor.options import executor_options, options_of
    from engine.limits import StepLimits
    from engine.speculative import SpeculativeConfig
    rows = GpuPlan.sample_rows.fget
    plan = lambda **kw: SimpleNamespace(options=options_of(**kw), max_seqs=kw["max_num_seqs"],
                                        max_tokens=kw["max_num_batched_tokens"])
    assert rows(plan(max_num_seqs=16, max_num_batched_tokens=512)) == 16
    assert rows(plan(max_num_seqs=16, max_num_batched_tokens=512, num_speculative_tokens=4)) == 80
    assert rows(plan(max_num_seqs=64, max_num_batched_tokens=128, num_speculative_tokens=4)) == 128
    config = EngineConfig(speculative_config=SpeculativeConfig("ngram", 3))
    assert executor_options(config, "cpu", StepLimits(256, 8, 64)).num_speculative_tokens == 3
    assert executor_options(EngineConfig(), "cpu", StepLimits(256, 8, 64)).num_speculative_tokens == 0


def test_a_verify_graphs_layout():
    """pad_verify_batch / pad_rows (a verify graph's static shape: 4 sequences of 5 rows): each real token's id,
    position and slot at its sequence's rows, padded rows position and slot -1; the padded rows sampled and
    accepted emit what the step's own rows emit (a grammar's masks moved with their rows)."""
    from engine.executor.verify_rows import pad_rows, pad_verify_batch
    steps, logits_by_seq = verify_case([("greedy", 3, None), ("sampled", 0, None),
                                        ("penalties", 4, FakeGrammar(length=9, seed=2))], seed=0)
    for i, step in enumerate(steps):
        step.block_table, step.start_pos = [7 + i, 2 * i], 9 + i
    batch = ModelBatch.build(steps)
    padded = pad_verify_batch(batch, 5, 4)
    assert padded.num_tokens == 20 and padded.cu_seqlens.tolist() == [0, 5, 10, 15, 20]
    real = [i * 5 + j for i, s in enumerate(steps) for j in range(len(s.token_ids))]
    assert padded.input_ids[real].tolist() == batch.input_ids.tolist()
    assert padded.positions[real].tolist() == batch.positions.tolist()
    assert padded.slot_mapping[real].tolist() == batch.slot_mapping.tolist()
    pad = np.setdiff1d(np.arange(20), real)
    assert (padded.positions[pad] == -1).all() and (padded.slot_mapping[pad] == -1).all()
    assert padded.block_tables[:3].tolist() == batch.block_tables.tolist() and not padded.block_tables[3].any()
    assert len(padded.seqs) == 4 and padded.sample_rows.tolist() == list(range(20))
    rows = pad_rows(verify_rows(steps), 5, 4)
    assert rows.num_rows == 20 and rows.bitmask[0] == list(range(10, 15))
    logits = (np.random.default_rng(9).standard_normal((20, V)) * 2).astype(np.float32)
    for i, lg in enumerate(logits_by_seq):
        logits[i * 5:i * 5 + len(lg)] = lg
    masks = dict(zip(*rows.bitmask))
    tokens = [sample_row(raw, st, allowed_tokens(masks[r], V) if r in masks else None)
              for r, (raw, st) in enumerate(zip(logits, rows.steps))]
    got = rows.accept(tokens)
    want = emulated_verify(np.concatenate(logits_by_seq), steps)
    assert [as_tuple(t) for t in got] == [as_tuple(t) for t in want]
    assert sum(len(t.accepted) for t in want) >= 2
    with pytest.raises(ValueError, match="does not fit"):
        pad_verify_batch(batch, 4, 4)


def test_verify_graph_buckets():
    from engine.executor.gpu_verify_graphs import VERIFY_GRAPH_MAX_SEQS, verify_buckets
    sizes = (1, 2, 4, 8, 16, 32)
    assert verify_buckets(sizes, 5, 512) == [b for b in sizes if b <= VERIFY_GRAPH_MAX_SEQS]
    assert verify_buckets(sizes, 5, 12) == [1, 2]


@pytest.mark.parametrize("group", [4, 8, 16])
def test_verify_graph_tiles(group):
    """A verify graph's paged_chunk.cu tiles (gpu_verify_graphs.py): the largest bucket's, each bucket's a prefix
    of them, covering each sequence's k + 1 rows in tiles of its own (16 GQA heads: two tiles a sequence)."""
    from engine.executor.gpu_chunk import chunk_tiles, tile_tokens
    per_seq, tokens = K_PAD, tile_tokens(group)
    big = chunk_tiles(np.arange(33) * per_seq, np.ones(32, bool), tokens)
    per = -(-per_seq // tokens)
    assert big.shape[0] == 32 * per
    for b in (1, 3, 8):
        tiles = big[:b * per]
        np.testing.assert_array_equal(tiles, chunk_tiles(np.arange(b + 1) * per_seq, np.ones(b, bool), tokens))
        rows = [r for t0, n in tiles.tolist() for r in range(t0, t0 + n)]
        assert rows == list(range(b * per_seq))
        assert all(t0 // per_seq == (t0 + n - 1) // per_seq for t0, n in tiles.tolist())


def test_the_graph_rows_of_a_padded_verify_step():
    """The per-row parameter block a verify graph's sampling tail reads (gpu_sampler.pack_graph_rows over pad_rows'
    steps): each real row its request's parameters and the draw step after the drafts before it; filler rows
    greedy (temperature 0), no logprobs."""
    from engine.executor.gpu_sampler import GRAPH_FIELDS, pack_graph_rows
    from engine.executor.verify_rows import pad_rows
    steps = [seq_step(PARAMS["sampled"], 2, [4, 8], seq_id=0), seq_step(PARAMS["greedy-logprobs"], 0, [], seq_id=1)]
    rows = pad_rows(verify_rows(steps), 3, 2)
    host = {name: np.full(6, 99, dtype) for name, dtype in GRAPH_FIELDS}
    pack_graph_rows(host, rows.steps, 6)
    assert host["temperature"].tolist() == pytest.approx([0.8, 0.8, 0.8, 0, 0, 0])
    assert host["step"].tolist() == [3, 4, 5, 0, 0, 0] and host["seed"].tolist() == [7, 7, 7, 0, 0, 0]
    assert host["logprobs"].tolist() == [1, 1, 1, 3, 0, 0]
    assert rows.compare.tolist() == [4, 8, -1, -1, -1, -1]


class FakeCupy:
    """What GpuVerify and Readback touch of CuPy, over host memory: pinned memory a bytearray, copies memmove,
    events that are always done."""

    class cuda:
        alloc_pinned_memory = staticmethod(bytearray)

        class Event:
            def __init__(self, *args, **kwargs):
                pass

            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        class runtime:
            memcpyHostToDevice, memcpyDeviceToHost = 1, 2

            @staticmethod
            def memcpyAsync(dst, src, nbytes, kind, stream):
                import ctypes
                ctypes.memmove(dst, src, nbytes)


def host_copy(pairs, to_host):
    """gpu_mapped_copy.MappedCopy's contract: 32-bit words between pinned host arrays and device arrays."""
    for host_array, device, words in pairs:
        dst, src = (host_array, device) if to_host else (device, host_array)
        np.asarray(dst).reshape(-1).view(np.int32)[:words] = np.asarray(src).reshape(-1).view(np.int32)[:words]


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_the_device_side_on_the_host(monkeypatch, padded):
    """GpuVerify.queue (its buffers, spec_accept.cu run by the host emulation) and Readback (its slots, one copy of
    the counts and ids, the logprobs), CuPy replaced by host memory: the sampler's per-row results become what
    the host's acceptance of the same rows gives, in the eager layout and a verify graph's padded one."""
    import sys

    from engine.executor import gpu_verify
    from engine.executor.gpu_readback import Readback
    from engine.executor.gpu_sampler import MAX_TOP_LOGPROBS
    from engine.executor.verify_rows import pad_rows
    from test_deltanet_kernels_emulated import EmulatedShared, host
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    monkeypatch.setattr(gpu_verify, "kernel", lambda name, entry: lambda grid, block, args, stream=None:
                        EmulatedShared().launch((name, entry, ()), grid, block, args))
    steps, logits = verify_case([("greedy-logprobs", 4, None), ("sampled", 2, None), ("greedy", 0, None),
                                 ("sampled", 4, None)], seed=2)
    rows = verify_rows(steps)
    want = rows.accept([sample_row(raw, st) for raw, st in zip(np.concatenate(logits), rows.steps)])
    if padded:
        rows = pad_rows(rows, K_PAD, 4)
        logits = [np.concatenate([lg, np.zeros((K_PAD - len(lg), V), np.float32)]) for lg in logits]
    tokens = [sample_row(raw, st) for raw, st in zip(np.concatenate(logits), rows.steps)]
    S, max_rows = rows.num_rows, 32
    arena = SimpleNamespace(take_all=lambda prefix, buffers: {b.name: host(np.zeros(b.shape, b.dtype)) for b in buffers})
    sampler = SimpleNamespace(ids=host(np.zeros(max_rows, np.int32)), logprob=host(np.zeros(max_rows, np.float32)),
                              top_ids=host(np.zeros((max_rows, MAX_TOP_LOGPROBS), np.int32)),
                              top_lp=host(np.zeros((max_rows, MAX_TOP_LOGPROBS), np.float32)))
    for r, t in enumerate(tokens):
        sampler.ids[r], sampler.logprob[r] = t.token_id, t.logprob if t.logprob is not None else 0.0
        for j, (tid, lp) in enumerate(t.top_logprobs):
            sampler.top_ids[r, j], sampler.top_lp[r, j] = tid, lp
    verify = gpu_verify.GpuVerify(arena, max_rows, 8, sampler, stream=SimpleNamespace(ptr=0))
    verify.check(len(rows.seqs), S)
    got = verify.queue(rows, False, Readback(max_rows, None, host_copy)).result().sampled
    assert [as_tuple(t) for t in got] == [as_tuple(t) for t in want]
    assert [len(t.accepted) for t in got] != [0] * 4

