"""Speculative decoding with the engine loop's overlap (async scheduling's fed steps, planning ahead) on the fake
executor that launches asynchronously (tests/engine/test_engine_overlap.py): steps the speculator predicts
draft-free (drafting off at the batch size, or no running sequence with a draft at the ids known) are launched
ahead as plain decode steps, the others verify their drafts as before; every client-visible event equals the
spec-off synchronous run's, through stop strings and tokens, n > 1, logprobs, preemption and aborts."""
from __future__ import annotations

from fake_executor import FakeExecutor, make_engine, run_until_idle, submit
from test_engine_overlap import AsyncFakeExecutor, client_view, requests
from test_spec_scheduler import ScriptedProposer, by_sample, reference
from test_spec_scheduler import run as spec_run

from engine.events import Finished, Token
from engine.ngram import NgramProposer
from engine.request import GenerateRequest, SamplingParams
from engine.sequence import SeqStatus, Sequence
from engine.speculative import SpeculativeConfig
from engine.speculator import Speculator


class Sparse(ScriptedProposer):
    """The scripted drafts (a spec-off run's tokens, a share corrupted) at some positions only: a function of
    the ids, so the steps between are draft-free."""

    def propose(self, seqs, limits):
        drafts = super().propose(seqs, limits)
        return [d if len(s.token_ids) % 9 < 3 else [] for s, d in zip(seqs, drafts)]


class Recording(AsyncFakeExecutor):
    """Records each step: (sequences, draft tokens, fed)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.shapes: list[tuple[int, int, bool]] = []

    def submit(self, batch, fed: bool = False):
        self.shapes.append((len(batch.seqs), sum(s.num_drafts for s in batch.seqs), fed))
        return super().submit(batch, fed)


def spec_off(reqs, **config):
    views, _ = spec_run(reqs, FakeExecutor(**config.pop("executor", {})), **config)
    return views


def run_async(reqs, proposer, spec, executor=None, async_scheduling=True, **config):
    """(client views, engine) of an async-scheduling run with speculation (async_scheduling False: planning ahead
    alone)."""
    engine = make_engine(executor or Recording(), speculative_config=spec, async_scheduling=async_scheduling, **config)
    engine.speculator.proposer = proposer
    streams = {r.request_id: submit(engine, r) for r in reqs}
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    return {rid: by_sample(client_view(ev)) for rid, ev in streams.items()}, engine


def test_async_speculation_sends_what_plain_decoding_sends():
    """Drafts at some positions (scripted, 30% wrong) or from prompt lookup; drafting off from 5 running
    sequences on: the requests cross that limit as they finish. Draft-free steps are launched ahead (fed),
    drafted ones verified."""
    reqs = requests()
    off = spec_off(reqs)
    spec = SpeculativeConfig("ngram", 4, 1, 3, disable_by_batch_size=5)
    for proposer in (Sparse(reference(off, reqs), 0.3, 262), NgramProposer(1, 3)):
        on, engine = run_async(reqs, proposer, spec)
        assert on == off
        c, ex = engine.speculator.counters, engine.executor
        assert c.num_draft_tokens == sum(d for _, d, _ in ex.shapes) > 0
        assert c.num_accepted_tokens > 0 or isinstance(proposer, NgramProposer)     # (the fake's logits: random)
        assert ex.fed_steps > 10 and any(d for _, d, _ in ex.shapes)
        assert not any(d and fed for _, d, fed in ex.shapes)        # a fed step never carries drafts
    on, engine = run_async(reqs, Sparse(reference(off, reqs), 0.3, 262), spec, async_scheduling=False)
    assert on == off and engine.executor.fed_steps == 0
    assert engine.stats().num_steps_planned_ahead > 10 and engine.speculator.counters.num_accepted_tokens > 0


def test_drafting_off_over_the_batch_limit_runs_overlapped():
    """A proposer with a draft for every sequence at every step: steps of 4 or more sequences (the limit) carry
    none and run fed, launched ahead; steps under it verify drafts; the counters count only those."""
    reqs = [GenerateRequest(f"q{i}", [30 + i] * (4 + i), SamplingParams(max_tokens=10 + 8 * i, temperature=0.0,
                                                                        ignore_eos=True)) for i in range(6)]
    off = spec_off(reqs)
    ex = Recording()
    on, engine = run_async(reqs, ScriptedProposer(reference(off, reqs), 0.2, 262),
                           SpeculativeConfig("ngram", 3, 1, 3, disable_by_batch_size=4), ex)
    assert on == off
    decodes = ex.shapes[1:]                       # after the prefill of all six
    assert all(not d for n, d, _ in decodes if n >= 4)
    assert sum(fed for n, _, fed in decodes if n >= 4) >= 0.8 * sum(1 for n, _, _ in decodes if n >= 4) > 5
    assert all(d for n, d, fed in decodes if n < 4 and not fed)   # under the limit: drafts every step
    c = engine.speculator.counters
    assert c.num_draft_tokens == sum(d for _, d, _ in ex.shapes) > 0


def test_preemption_and_aborts_with_async_speculation():
    reqs = [GenerateRequest(f"r{i}", [10 + i] * 20, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                                                   stop=["\x7f"]))
            for i in range(6)]
    off = spec_off(reqs, executor={"num_kv_blocks": 14}, max_num_seqs=6)
    spec = SpeculativeConfig("ngram", 4, 1, 3)
    on, engine = run_async(reqs, Sparse(reference(off, reqs), 0.3, 262), spec, Recording(num_kv_blocks=14),
                           max_num_seqs=6)
    assert on == off and engine.scheduler.num_preemptions > 0 and engine.executor.fed_steps > 0

    engine = make_engine(Recording(), speculative_config=spec, async_scheduling=True)
    engine.speculator.proposer = Sparse({}, 0.0, 262)
    events = submit(engine, requests()[0])
    for _ in range(4):
        engine.step()
    engine.abort("plain")
    run_until_idle(engine)
    finished = [e for e in events if isinstance(e, Finished)]
    assert [f.reason for f in finished] == ["abort"] and events[-1] is None
    assert all(not isinstance(e, Token) for e in events[events.index(finished[0]):])
    assert engine.executor.fed_steps > 0


class GpuLike(Recording):
    spec_off_batch_size = 3


def test_the_executors_default_batch_limit():
    """An executor's default limit (the GPU's: 32 running sequences) applies where the config sets no schedule;
    a config's own schedule stands."""
    reqs = [GenerateRequest(f"q{i}", [40 + i] * 5, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i in range(4)]
    off = spec_off(reqs)
    proposer = ScriptedProposer(reference(off, reqs), 0.0, 262)
    on, engine = run_async(reqs, proposer, SpeculativeConfig("ngram", 2, 1, 3), GpuLike())
    assert on == off and engine.speculator.config.disable_by_batch_size == 3
    assert engine.speculator.counters.num_drafts == 0 and engine.executor.fed_steps > 5
    own = SpeculativeConfig("ngram", 2, 1, 3, num_speculative_tokens_per_batch_size=((1, 100, 2),))
    on, engine = run_async(reqs, proposer, own, GpuLike())
    assert on == off and engine.speculator.counters.num_drafts > 10


class Looked:
    """A proposer with a look of its own (the GPU's none_drafted: the last landed read-back, no wait)."""

    def __init__(self, none: bool):
        self.none, self.calls = none, []

    def propose(self, seqs, limits):
        self.calls.append("propose")
        return [[1] for _ in seqs]

    def none_drafted(self, seqs):
        self.calls.append("look")
        return self.none


def test_the_prediction_asks_the_proposers_look_once_the_ids_change():
    """Right after a proposal (the same ids) its answer stands; at new ids a proposer's own look answers (no
    drafting); drafting off at the batch size answers without either."""
    seqs = [Sequence(i, f"r{i}", [3, 4, 5], 3, SamplingParams(max_tokens=20)) for i in range(3)]
    for seq in seqs:
        seq.status, seq.num_computed = SeqStatus.RUNNING, 2
    proposer = Looked(none=True)
    sp = Speculator(SpeculativeConfig("ngram", 2, 1, 2, disable_by_batch_size=3), 512, proposer)
    sp.propose(seqs[:2])
    assert not sp.draft_free_next(seqs[:2]) and proposer.calls == ["propose"]
    seqs[0].token_ids.append(7)
    assert sp.draft_free_next(seqs[:2]) and proposer.calls == ["propose", "look"]
    assert sp.draft_free_next(seqs) and proposer.calls == ["propose", "look"]      # 3 running: drafting off
