"""Speculative decoding's engine machinery on the fake executor (tests/fake_executor.py: logits hashed from the
whole context read back through the block tables, every read slot checked written), with a scripted
proposer that knows each sequence's spec-off continuation and corrupts a share of it: whatever the drafts,
every client-visible event equals the spec-off run's — through stop strings and tokens, max_tokens,
min_tokens, logprobs, n > 1, penalties, chunked prefill, preemption, prefix hits and aborts — no block holding
a rejected draft's KV is ever hashed, and blocks holding only rejected drafts are freed."""
from __future__ import annotations

import random

import numpy as np
import pytest
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit
from test_engine_overlap import client_view, requests

from engine.events import Finished, Token
from engine.request import GenerateRequest, SamplingParams
from engine.speculative import SpeculativeConfig
from engine.speculator import Speculator
from engine.step_budget import MIN_PREFILL, Products, StepCost
from memory.kv_pool import BLOCK_SIZE, blocks_for
from memory.prefix_hash import hash_chain

SPEC = SpeculativeConfig("ngram", 6, 1, 3)


class ScriptedProposer:
    """Drafts from a spec-off run's token ids of each (request, sample), each draft token replaced by a wrong
    one with probability `wrong` (seeded by the sequence and its length: the same drafts every run)."""

    def __init__(self, reference: dict[tuple[str, int], list[int]], wrong: float, vocab: int):
        self.reference, self.wrong, self.vocab = reference, wrong, vocab

    def propose(self, seqs, limits):
        out = []
        for seq, k in zip(seqs, limits):
            ref = self.reference.get((seq.request_id, seq.index), [])
            n = len(seq.token_ids)
            draft = list(ref[n:n + k]) if ref[:n] == seq.token_ids else []
            rng = random.Random(f"{seq.request_id}/{seq.index}/{n}")
            out.append([(t + 1 + rng.randrange(self.vocab - 1)) % self.vocab if rng.random() < self.wrong else t
                        for t in draft])
        return out


def run(reqs, executor=None, spec=None, proposer=None, on_step=None, **config):
    """(client views by request, engine) of one engine run."""
    engine = make_engine(executor or FakeExecutor(), speculative_config=spec, **config)
    if proposer is not None:
        engine.speculator.proposer = proposer
    streams = {r.request_id: submit(engine, r) for r in reqs}
    run_until_idle(engine, on_step=on_step and (lambda _: on_step(engine)))
    engine.block_manager.check_invariants(idle=True)
    return {rid: by_sample(client_view(ev)) for rid, ev in streams.items()}, engine


def by_sample(events: list) -> list:
    """Events in order per sample (n > 1: a step may send several tokens of one sample and one of another)."""
    return sorted(events, key=lambda e: getattr(e, "index", -1) if e is not None else 1 << 30)


def reference(views, reqs) -> dict[tuple[str, int], list[int]]:
    prompts = {r.request_id: list(r.prompt_token_ids) for r in reqs}
    out: dict[tuple[str, int], list[int]] = {}
    for rid, events in views.items():
        for e in events:
            if isinstance(e, Token):
                out.setdefault((rid, e.index), list(prompts[rid])).append(e.token_id)
    return out


def check_hashed_blocks_hold_their_tokens(engine) -> None:
    """Every block in the prefix cache holds, in its KV slots (the fake executor stores token ids), exactly the
    tokens of its hash: a block hashed while it held a rejected draft's KV fails this."""
    bm, kv = engine.block_manager, engine.executor.kv.reshape(-1, BLOCK_SIZE)
    for block_hash, block in bm.cached.items():
        (parent, adapter), _, _ = bm._origin[block]
        assert hash_chain(kv[block].tolist(), BLOCK_SIZE, adapter, parent) == [block_hash], f"block {block}"


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_every_event_equals_the_spec_off_run(wrong):
    reqs = requests()
    off, _ = run(reqs)
    proposer = ScriptedProposer(reference(off, reqs), wrong, 262)
    on, engine = run(reqs, spec=SPEC, proposer=proposer, on_step=check_hashed_blocks_hold_their_tokens)
    assert on == off
    c = engine.speculator.counters
    assert c.num_drafts > 20 and c.num_draft_tokens > c.num_drafts
    if wrong == 0.0:        # every draft right: only the ends cut a draft short
        assert c.num_accepted_tokens > 0.8 * c.num_draft_tokens
    if wrong == 1.0:
        assert c.num_accepted_tokens == 0
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens
    assert c.accepted_per_pos == sorted(c.accepted_per_pos, reverse=True)
    stats = engine.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_accepted_tokens) == (c.num_drafts,
                                                                                     c.num_accepted_tokens)


def test_verify_steps_cost_fewer_steps_and_respect_the_budget():
    reqs = [GenerateRequest(f"r{i}", [20 + i] * 5, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                                  logprobs=1)) for i in range(5)]
    off, off_engine = run(reqs, max_num_batched_tokens=16)
    ex = FakeExecutor()
    on, engine = run(reqs, executor=ex, spec=SPEC, proposer=ScriptedProposer(reference(off, reqs), 0.1, 262),
                     max_num_batched_tokens=16)
    assert on == off
    assert engine.stats().num_steps < 0.6 * off_engine.stats().num_steps
    assert max(b.num_tokens for b in ex.steps) <= 16
    assert any(0 < s.num_drafts < SPEC.num_speculative_tokens for b in ex.steps for s in b.seqs)   # cut to fit


def test_rejected_blocks_are_freed_and_never_hashed():
    """A 15-token prompt: the first verify step's drafts cross into a second and third block; all rejected,
    only the block the next token goes to is kept; the prefix cache holds accepted tokens only."""
    req = GenerateRequest("a", list(range(1, 16)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    off, _ = run([req])
    ref = reference(off, [req])
    wrong = ScriptedProposer(ref, 1.0, 262)
    engine = make_engine(FakeExecutor(), speculative_config=SpeculativeConfig("ngram", 20, 1, 3))
    engine.speculator.proposer = wrong
    events = submit(engine, req)
    engine.step()                                   # the prefill, its first token
    seq = engine.scheduler.running[0]
    assert len(seq.block_table) == 1 and seq.num_computed == 15
    engine.step()                                   # feeds 1 + 20 tokens: positions 15..35, blocks 0..2
    assert seq.num_computed == 16 and len(seq.token_ids) == 17
    assert len(seq.block_table) == blocks_for(17) == 2       # block 2 held rejected drafts only: freed
    assert engine.block_manager.num_used_blocks == 2
    assert len(engine.block_manager.cached) == 1             # block 0 (accepted tokens 0..15) only
    check_hashed_blocks_hold_their_tokens(engine)
    run_until_idle(engine, on_step=lambda _: check_hashed_blocks_hold_their_tokens(engine))
    assert by_sample(client_view(events)) == off["a"]


def test_prefix_hits_on_blocks_a_verify_step_cached():
    """Blocks of accepted drafts join the prefix cache; a later prompt that continues the output hits them and
    generates what it generates with no cache."""
    first = GenerateRequest("a", [7] * 12, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    off, _ = run([first])
    out = reference(off, [first])[("a", 0)]
    second = GenerateRequest("b", out[:45] + [3, 4], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    cold, _ = run([second], enable_prefix_caching=False)
    engine = make_engine(FakeExecutor(), speculative_config=SPEC)
    engine.speculator.proposer = ScriptedProposer(reference(off, [first]) | reference(cold, [second]), 0.2, 262)
    a = submit(engine, first)
    run_until_idle(engine)
    b = submit(engine, second)
    run_until_idle(engine)
    check_hashed_blocks_hold_their_tokens(engine)
    assert by_sample(client_view(a)) == off["a"] and by_sample(client_view(b)) == cold["b"]
    assert engine.stats().prefix_cache_hits >= 32               # two blocks of `out` written by verify steps


def test_preemption_and_aborts_with_drafts_in_flight():
    reqs = [GenerateRequest(f"r{i}", [10 + i] * 20, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
            for i in range(6)]
    off, _ = run(reqs, executor=FakeExecutor(num_kv_blocks=14), max_num_seqs=6)
    on, engine = run(reqs, executor=FakeExecutor(num_kv_blocks=14), spec=SPEC,
                     proposer=ScriptedProposer(reference(off, reqs), 0.3, 262), max_num_seqs=6)
    assert engine.scheduler.num_preemptions > 0 and on == off

    engine = make_engine(FakeExecutor(), speculative_config=SPEC)
    engine.speculator.proposer = ScriptedProposer(reference(off, reqs), 0.0, 262)
    events = submit(engine, reqs[0])
    for _ in range(3):
        engine.step()
    assert engine.scheduler.running[0].num_generated > 3        # drafts were accepted
    engine.abort("r0")
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    assert [e.reason for e in events if isinstance(e, Finished)] == ["abort"]


def test_max_tokens_and_stops_inside_accepted_drafts():
    """All drafts right (k = 8): a stop token, a stop string or max_tokens inside a verify step's accepted
    drafts ends the sequence there."""
    base = GenerateRequest("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    off, _ = run([base])
    out = reference(off, [base])[("x", 0)][3:]
    text = "".join(chr(t) for t in out if 32 <= t < 127)
    cases = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[out[6]]),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=8, stop_token_ids=[out[4], out[9]]),
             SamplingParams(temperature=0, max_tokens=40, stop=[text[5:7]] if len(text) > 7 else ["\x00"],
                            ignore_eos=True)]
    reqs = [GenerateRequest(f"c{i}", [5, 6, 7], p) for i, p in enumerate(cases)]
    want, _ = run(reqs)
    got, engine = run(reqs, spec=SpeculativeConfig("ngram", 8, 1, 3),
                      proposer=ScriptedProposer({(r.request_id, 0): [5, 6, 7] + out for r in reqs}, 0.0, 262))
    assert got == want
    assert [e.reason for e in got["c0"] if isinstance(e, Finished)] == ["length"]
    assert engine.speculator.counters.num_accepted_tokens > 0


def test_sampling_with_penalties_bias_and_filters_is_unchanged():
    """Seeded sampling emits the same tokens with speculation: each verified row draws with its own
    step's uniform over its own history (penalties count the drafts before it)."""
    reqs = [GenerateRequest(f"s{i}", [30 + i, 31, 30 + i, 31], SamplingParams(
        temperature=[0.7, 1.0, 1.3][i % 3], top_p=[1.0, 0.9][i % 2], top_k=[-1, 20, 5][i % 3], min_p=0.02 * (i % 2),
        seed=100 + i, max_tokens=30, repetition_penalty=[1.0, 1.3][i % 2], frequency_penalty=0.5 * (i % 3 == 1),
        presence_penalty=0.4 * (i % 3 == 2), logit_bias={33: 2.0, 34: -1.0}, min_tokens=3, logprobs=3))
        for i in range(9)]
    off, _ = run(reqs, executor=FakeExecutor(scale=1.0))
    on, engine = run(reqs, executor=FakeExecutor(scale=1.0), spec=SPEC,
                     proposer=ScriptedProposer(reference(off, reqs), 0.25, 262))
    assert on == off
    assert engine.speculator.counters.num_accepted_tokens > 50


def test_k_follows_the_batch_size_schedule():
    """[[1, 1, 4], [2, 64, 0]]: no drafts while two or more sequences run, k = 4 once one is left."""
    spec = SpeculativeConfig("ngram", 4, 1, 3, num_speculative_tokens_per_batch_size=((1, 1, 4), (2, 64, 0)))
    reqs = [GenerateRequest(f"r{i}", [40 + i] * 3, SamplingParams(temperature=0, max_tokens=10 + 20 * i,
                                                                  ignore_eos=True)) for i in range(3)]
    off, _ = run(reqs)
    ex = FakeExecutor()
    on, _ = run(reqs, executor=ex, spec=spec, proposer=ScriptedProposer(reference(off, reqs), 0.0, 262))
    assert on == off
    drafts = [(len(b.seqs), max(s.num_drafts for s in b.seqs)) for b in ex.steps]
    assert all(d == 0 for n, d in drafts if n > 1) and any(d == 4 for n, d in drafts if n == 1)


class Threes:
    def propose(self, seqs, limits):
        return [[3] * 50 for _ in seqs]


def test_proposals_never_run_past_max_model_len_or_max_tokens():
    speculator = Speculator(SpeculativeConfig("ngram", 8, 1, 1), max_model_len=20, proposer=Threes())
    engine = make_engine(FakeExecutor(), max_model_len=20)
    submit(engine, GenerateRequest("a", [1, 2] * 7, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    engine.step()
    seq = engine.scheduler.running[0]
    speculator.propose([seq])
    assert seq.draft_ids == [3] * min(8, 6 - 1 - 1, 20 - 15)
    seq.token_ids += [1, 2]                                     # 17 tokens, 3 generated: room for 2
    seq.num_computed = 16
    speculator.propose([seq])
    assert seq.draft_ids == [3, 3]
    seq.num_computed = 15                                       # not a decode (a token not yet computed): none
    speculator.propose([seq])
    assert seq.draft_ids == []


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_host_tier_restores_only_accepted_blocks(prefix_caching):
    """A small device pool and a host KV tier (write-back, and pure-host mode without prefix caching): blocks
    written by verify steps go to the host and come back for a prompt that continues an output; it generates
    what it generates cold. A block offloaded while it held a rejected draft's KV would come back wrong."""
    first = GenerateRequest("a", [9] * 10, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    off, _ = run([first])
    out = reference(off, [first])[("a", 0)]
    second = GenerateRequest("b", out[:66] + [1, 2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    fillers = [GenerateRequest(f"f{i}", [100 + i] * 150, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
               for i in range(3)]
    cold, _ = run([second], enable_prefix_caching=False)
    engine = make_engine(FakeExecutor(num_kv_blocks=12, host_kv_blocks=32), speculative_config=SPEC,
                         host_kv_blocks=32, enable_prefix_caching=prefix_caching)
    engine.speculator.proposer = ScriptedProposer(reference(off, [first]) | reference(cold, [second]), 0.3, 262)
    got = {}
    for r in [first] + fillers + [second]:          # the fillers push the first request's blocks to the host
        got[r.request_id] = submit(engine, r)
        run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    assert by_sample(client_view(got["a"])) == off["a"] and by_sample(client_view(got["b"])) == cold["b"]
    assert engine.scheduler.host_tier.slots.restored_blocks >= 3 and engine.speculator.counters.num_accepted_tokens > 20


def test_drafts_never_take_a_decode_or_the_first_prefill_chunk():
    """Both step budgets with drafts: the token budget keeps a token for every running sequence after a verify
    step (4 streams, 6 drafts each, 12 tokens: no stream ever skips a step) and MIN_PREFILL for a waiting
    prompt; the work budget (a cost model) cuts the drafts, never a decode; a verify step is no prefill, so the
    prompt joining gets its first chunk at once (scheduling order: the drafts fit the work left at their turn)."""
    streams = [GenerateRequest(f"s{i}", [30 + i] * 3, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
               for i in range(4)]
    late = GenerateRequest("late", list(range(100, 160)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    off, _ = run(streams + [late], max_num_batched_tokens=12)
    ex = FakeExecutor()
    ex.step_cost = cost = StepCost(0.0, Products(1.0, 0.0, 1.0), Products(0.0, 0.0, 0.0), 0.0, key=0.05, pair=0.02,
                                   target=12)
    engine = make_engine(ex, speculative_config=SPEC, max_num_batched_tokens=12)
    engine.speculator.proposer = ScriptedProposer(reference(off, streams + [late]), 0.0, 262)
    events = {r.request_id: submit(engine, r) for r in streams}
    for _ in range(4):
        engine.step()                                      # the prompts, then verify steps
    events["late"] = submit(engine, late)
    ex.steps.clear()
    run_until_idle(engine)
    assert {rid: by_sample(client_view(ev)) for rid, ev in events.items()} == off
    first = [s for s in ex.steps[0].seqs if s.prompt_len == 60]
    assert first and len(first[0].token_ids) >= MIN_PREFILL, ex.steps[0].seqs
    steps_of = {}
    for at, step in enumerate(ex.steps):
        for s in step.seqs:
            steps_of.setdefault(s.seq_id, []).append(at)
        assert sum(len(s.token_ids) for s in step.seqs) <= 12
        work = np.cumsum([len(s.token_ids) + cost.own(s.start_pos, len(s.token_ids)) for s in step.seqs])
        assert all(w <= 12 + 1e-9 for w, s in zip(work, step.seqs) if s.num_drafts), step.seqs  # drafts fit the work left
    assert all(at == list(range(at[0], at[-1] + 1)) for at in steps_of.values()), steps_of    # none skipped
    assert sum(s.num_drafts for step in ex.steps for s in step.seqs) > 20
