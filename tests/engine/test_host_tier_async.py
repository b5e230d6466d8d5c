"""Asynchronous host-tier copies (an executor with supports_async_copies): a sequence whose prefix
comes back from the host tier waits LOADING until its copies land, while the other sequences' steps go
on; then it runs as if restored synchronously; and blocks that join the device prefix cache are written
through to the host at once, held until that copy lands, so evicting them copies nothing. The stand-in
executor lands a ticket with restores once `delay` steps have run since it was issued (others after
`write_delay`; or on wait_copies), poisons
the destination blocks and slots until then and reads the sources only when it lands: a sequence
computed before its copies land, a held slot or block reused, a slot restored before its write lands,
or a block given back while its copy still writes it changes the outputs or trips an assert."""
from __future__ import annotations

import pytest

from engine.batch import BLOCK_SIZE
from engine.events import Finished, Token
from engine.request import GenerateRequest, SamplingParams
from engine.sequence import SeqStatus
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit
from memory.prefix_hash import hash_chain
from test_host_tier import cached, prompt_then_evict_then_again, tokens

POISON = 255


class Ticket:
    def __init__(self, restores, through, land_at: int, kv):
        self.restores, self.through, self.land_at, self.landed = list(restores), list(through), land_at, False
        self.sources = {block: kv[block].copy() for block, _ in through}   # a held block must not change


class AsyncCopies(FakeExecutor):
    supports_async_copies = True

    def __init__(self, delay: int = 3, write_delay: int = 1, **kw):
        super().__init__(**kw)
        self.delay, self.write_delay, self.tickets = delay, write_delay, []

    def copy_blocks(self, offloads, restores, through=()):
        super().copy_blocks(offloads, [])
        kv = self.kv.reshape(-1, BLOCK_SIZE)
        for _, block in restores:
            kv[block] = POISON                  # what the block holds until the copy lands
        ticket = Ticket(restores, through, len(self.steps) + (self.delay if restores else self.write_delay), kv)
        for _, slot in through:
            self.host[slot] = POISON            # what the slot holds until the write lands
        self.tickets.append(ticket)
        return ticket

    def _land(self, ticket: Ticket) -> None:
        if not ticket.landed:
            kv = self.kv.reshape(-1, BLOCK_SIZE)
            for block, slot in ticket.through:
                assert (kv[block] == ticket.sources[block]).all(), "a held block changed before its copy"
                self.host[slot] = kv[block]
            for slot, block in ticket.restores:
                assert (kv[block] == POISON).all(), "a restored block was written before its copy landed"
                kv[block] = self.host[slot]
            ticket.landed = True

    def copies_done(self, ticket) -> bool:
        if len(self.steps) >= ticket.land_at:      # `delay` steps after it was issued
            self._land(ticket)
        return ticket.landed

    def wait_copies(self, ticket) -> None:
        self._land(ticket)


def settle(engine, ex: AsyncCopies) -> None:
    """Land every copy in flight and let the scheduler take their blocks and slots back (an engine stepped
    until idle has: copies that hold blocks count as its work)."""
    for t in ex.tickets:
        ex.wait_copies(t)
    engine.scheduler.land_copies()


def until_finished(engine, events: list) -> None:
    """Step the engine until the request of `events` is done (its copies may still be in flight)."""
    while not any(isinstance(e, Finished) for e in events):
        engine.step()
        engine.drain_inbox()


PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(30, 130))                      # 100 tokens: 6 full blocks to restore


def prefix_back_beside_a_busy_request(engine, others: int, busy_tokens: int):
    """PROMPT run once, `others` prompts that push (some of) its blocks out to the tier, a request
    decoding busy_tokens tokens started, then PROMPT again, admitted in the step after: the events of
    (the first run, the busy request, the second run)."""
    first = submit(engine, GenerateRequest("a1", PROMPT, PARAMS))
    run_until_idle(engine)
    for i in range(others):
        submit(engine, GenerateRequest(f"o{i}", [200 + i] + list(range(1, 70)), PARAMS))
        run_until_idle(engine)
    busy = submit(engine, GenerateRequest("busy", [7] * 20, SamplingParams(temperature=0.0, max_tokens=busy_tokens,
                                                                         ignore_eos=True)))
    engine.step()
    second = submit(engine, GenerateRequest("a2", PROMPT, PARAMS))
    engine.step()                                    # a2 admitted: its copies issued, it waits LOADING
    return first, busy, second


@pytest.mark.parametrize("delay", [1, 4])
def test_async_restore_gives_the_synchronous_outputs(delay):
    runs = {}
    for name, ex in (("sync", FakeExecutor(num_kv_blocks=12, host_kv_blocks=64)),
                     ("async", AsyncCopies(delay, num_kv_blocks=12, host_kv_blocks=64))):
        engine = make_engine(ex, host_kv_blocks=64)
        settle_ = (lambda e=engine, x=ex: settle(e, x)) if name == "async" else (lambda: None)
        runs[name] = prompt_then_evict_then_again(engine, PROMPT, PARAMS, settle=settle_)
        assert engine.scheduler.host_tier.async_copies is (name == "async")
        assert not engine.scheduler.loading and not engine.scheduler.host_tier.draining
    (a0, b0), (a1, b1) = runs["sync"], runs["async"]
    assert tokens(a0) == tokens(b0) == tokens(a1) == tokens(b1) and len(tokens(b1)) == 12
    assert cached(b0) == cached(b1) == 96


def test_others_run_while_a_prefix_loads_and_held_slots_are_not_reused():
    """While one request's blocks load (for 6 steps), a running request keeps
    decoding and new prompts evict into the small tier; the loading request then matches a cold run."""
    ex = AsyncCopies(delay=6, num_kv_blocks=24, host_kv_blocks=12)
    engine = make_engine(ex, host_kv_blocks=12)
    first, busy, second = prefix_back_beside_a_busy_request(engine, others=4, busy_tokens=40)
    seq = next(s for s in engine.scheduler.loading if s.request_id == "a2")
    assert seq.status is SeqStatus.LOADING and cached(second) == 96
    assert engine.stats().num_running == 2                # a loading request counts as admitted
    ran_while_loading = 0
    while seq.status is SeqStatus.LOADING:
        before = len(tokens(busy))
        submit(engine, GenerateRequest(f"n{ran_while_loading}", [150 + ran_while_loading] + list(range(1, 40)),
                                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
        engine.step()
        ran_while_loading += len(tokens(busy)) > before
    assert ran_while_loading >= 3                    # the busy request decoded meanwhile
    run_until_idle(engine)
    assert tokens(second) == tokens(first)
    settle(engine, ex)
    engine.block_manager.check_invariants(idle=True)


def test_a_request_aborted_while_loading_gives_its_blocks_back_after_the_copy():
    ex = AsyncCopies(delay=1000, num_kv_blocks=12, host_kv_blocks=64)   # lands only on wait_copies
    engine = make_engine(ex, host_kv_blocks=64)
    _, busy, events = prefix_back_beside_a_busy_request(engine, others=8, busy_tokens=30)
    seq = engine.scheduler.loading[0]
    blocks = list(seq.load.blocks)
    engine.abort("a2")
    engine.drain_inbox()
    engine.step()
    assert not engine.scheduler.loading and len(engine.scheduler.host_tier.draining) == 1
    assert all(engine.block_manager.ref_counts[b] == 1 for b in blocks)   # still held: the copy writes them
    ticket = engine.scheduler.host_tier.draining[0].ticket
    ex.wait_copies(ticket)
    engine.step()
    assert not engine.scheduler.host_tier.draining
    assert all(engine.block_manager.ref_counts[b] == 0 for b in blocks)
    run_until_idle(engine)
    assert not [e for e in events if isinstance(e, Token)]
    assert len(tokens(busy)) == 30
    settle(engine, ex)
    engine.block_manager.check_invariants(idle=True)
    assert engine.scheduler.host_tier.slots._held == {}



def test_a_restore_does_not_wait_for_write_throughs():
    """Restores and write-throughs are issued apart (each its own ticket: on the GPU, streams of their own),
    so a prefix coming back from the tier runs once its restore lands while the write-throughs issued
    beside it are still in flight (here they land only when waited for)."""
    ex = AsyncCopies(delay=1, write_delay=1000, num_kv_blocks=24, host_kv_blocks=64)
    engine = make_engine(ex, host_kv_blocks=64)
    first = submit(engine, GenerateRequest("a1", PROMPT, PARAMS))
    run_until_idle(engine)
    for i in range(4):                                   # PROMPT's blocks pushed out to the tier
        submit(engine, GenerateRequest(f"o{i}", [200 + i] + list(range(1, 70)), PARAMS))
        run_until_idle(engine)
        settle(engine, ex)
    busy = submit(engine, GenerateRequest("busy", [7] * 40, SamplingParams(temperature=0.0, max_tokens=30,
                                                                         ignore_eos=True)))
    engine.step()                                        # its prompt's blocks: write-throughs in flight
    second = submit(engine, GenerateRequest("a2", PROMPT, PARAMS))
    engine.step()
    seq = next(s for s in engine.scheduler.loading if s.request_id == "a2")
    assert engine.scheduler.host_tier.writing and all(not (t.through and t.restores) for t in ex.tickets)
    for _ in range(3):
        engine.step()
    assert seq.status is SeqStatus.RUNNING and engine.scheduler.host_tier.writing     # writes still in flight
    run_until_idle(engine)
    assert tokens(second) == tokens(first) and len(tokens(busy)) == 30
    settle(engine, ex)
    engine.block_manager.check_invariants(idle=True)


def test_blocks_are_written_through_and_eviction_copies_nothing():
    """With asynchronous copies every block that joins the prefix cache goes to the host tier at once
    (held until it lands), so the evictions that follow copy nothing, and the evicted prefix still
    comes back (restored, LOADING) with the synchronous run's outputs."""
    ex = AsyncCopies(delay=2, num_kv_blocks=12, host_kv_blocks=64)
    engine = make_engine(ex, host_kv_blocks=64)
    first, second = prompt_then_evict_then_again(engine, PROMPT, PARAMS, settle=lambda: settle(engine, ex))
    tier = engine.scheduler.host_tier.slots
    through = sum(len(t.through) for t in ex.tickets)
    assert through >= 6 and tier.stored_blocks == through          # every stored block was written through
    assert tier.offloads == [] and not engine.scheduler.host_tier.writing
    assert tokens(second) == tokens(first) and cached(second) == 96
    engine.block_manager.check_invariants(idle=True)
    assert tier._held == {} and tier._writing == set()


def test_a_slot_is_not_restored_before_its_write_lands():
    """A prefix whose host copy is still being written is not looked up there (the lookup stops at it)."""
    from memory.host_tier import HostKVTier

    tier = HostKVTier(8)
    tier.store(11, 0)
    assert tier.store_through(12, 1) is not None and tier.store_through(13, 2) is not None
    assert tier.store_through(12, 5) is None                       # already here: no second copy
    assert tier.lookup([11, 12, 13]) == [tier.slot_of[11]]
    tier.done_writing([tier.slot_of[12]])
    assert tier.lookup([11, 12, 13]) == [tier.slot_of[11], tier.slot_of[12]]
    for _ in range(8):                                             # a held slot is never taken
        tier.store(100 + _, 3)
    assert 13 in tier.slot_of


def test_a_block_written_through_is_not_evicted_before_its_copy_lands():
    """A pool too small for two prompts: the second needs the first's cached blocks while their
    write-through copies (landing 5 steps after issue) are in flight; it waits for them (the engine waits
    on the copies when nothing can run) instead of evicting and overwriting a block being copied."""
    ex = AsyncCopies(delay=1, write_delay=5, num_kv_blocks=8, host_kv_blocks=32)
    engine = make_engine(ex, host_kv_blocks=32)
    a = submit(engine, GenerateRequest("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    until_finished(engine, a)
    assert engine.scheduler.host_tier.writing and engine.has_work()     # not idle until they land                   # its blocks still being written through
    b = submit(engine, GenerateRequest("b", [201] + list(range(1, 90)), PARAMS))
    run_until_idle(engine)
    settle(engine, ex)
    assert len(tokens(a)) == 2 and len(tokens(b)) == 12
    again = submit(engine, GenerateRequest("a2", PROMPT, SamplingParams(temperature=0.0, max_tokens=2,
                                                                       ignore_eos=True)))
    run_until_idle(engine)
    settle(engine, ex)
    assert tokens(again) == tokens(a) and cached(again) == 96   # the written-through prefix came back
    engine.block_manager.check_invariants(idle=True)


def test_the_prefix_cache_reset_waits_for_write_throughs_in_flight():
    """POST /reset_prefix_cache right after a request: its blocks' write-through copies are still in
    flight (held); the reset lands them first, so the prefix leaves the device and a repeat comes back
    from the host tier."""
    ex = AsyncCopies(delay=1, write_delay=50, num_kv_blocks=32, host_kv_blocks=32)
    engine = make_engine(ex, host_kv_blocks=32)
    first = submit(engine, GenerateRequest("a", PROMPT, PARAMS))
    until_finished(engine, first)
    assert engine.scheduler.host_tier.writing
    engine.reset_prefix_cache()
    assert not engine.scheduler.host_tier.writing
    assert engine.block_manager.lookup(hash_chain(PROMPT[:96], BLOCK_SIZE)) == []
    again = submit(engine, GenerateRequest("a2", PROMPT, PARAMS))
    run_until_idle(engine)
    settle(engine, ex)
    assert cached(again) == 96 and tokens(again) == tokens(first)
    assert engine.scheduler.host_tier.slots.restored_blocks == 6
