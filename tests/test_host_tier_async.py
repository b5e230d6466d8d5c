"""Asynchronous host-tier restores (an executor with supports_async_restore): a sequence whose prefix
comes back from the host tier waits LOADING until its copies land, while the other sequences' steps go
on; then it runs as if restored synchronously. The stand-in executor lands a restore only after
copies_done has been asked `delay` times (or on wait_copies), poisons the destination blocks until then
and reads the host slots only when it lands: a sequence computed before its copies land, a held slot
reused, or a block given back while its copy still writes it changes the outputs or trips an assert."""
from __future__ import annotations

import pytest

from engine.batch import BLOCK_SIZE
from engine.events import Token
from engine.request import GenerateRequest, SamplingParams
from engine.sequence import SeqStatus
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit
from test_host_tier import cached, prompt_then_evict_then_again, tokens

POISON = 255


class Ticket:
    def __init__(self, restores, delay: int):
        self.restores, self.polls_left, self.landed = list(restores), delay, False


class AsyncCopies(FakeExecutor):
    supports_async_restore = True

    def __init__(self, delay: int = 3, **kw):
        super().__init__(**kw)
        self.delay, self.tickets, self.polls = delay, [], 0

    def copy_blocks(self, offloads, restores):
        super().copy_blocks(offloads, [])
        kv = self.kv.reshape(-1, BLOCK_SIZE)
        for _, block in restores:
            kv[block] = POISON                  # what the block holds until the copy lands
        ticket = Ticket(restores, self.delay)
        self.tickets.append(ticket)
        return ticket

    def _land(self, ticket: Ticket) -> None:
        if not ticket.landed:
            kv = self.kv.reshape(-1, BLOCK_SIZE)
            for slot, block in ticket.restores:
                assert (kv[block] == POISON).all(), "a restored block was written before its copy landed"
                kv[block] = self.host[slot]
            ticket.landed = True

    def copies_done(self, ticket) -> bool:
        self.polls += 1
        ticket.polls_left -= 1
        if ticket.polls_left <= 0:
            self._land(ticket)
        return ticket.landed

    def wait_copies(self, ticket) -> None:
        self._land(ticket)


PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(30, 130))                      # 100 tokens: 6 full blocks to restore


@pytest.mark.parametrize("delay", [1, 4])
def test_async_restore_gives_the_synchronous_outputs(delay):
    runs = {}
    for name, ex in (("sync", FakeExecutor(num_kv_blocks=12, host_kv_blocks=64)),
                     ("async", AsyncCopies(delay, num_kv_blocks=12, host_kv_blocks=64))):
        engine = make_engine(ex, host_kv_blocks=64)
        runs[name] = prompt_then_evict_then_again(engine, PROMPT, PARAMS)
        assert engine.scheduler.async_restore is (name == "async")
        assert not engine.scheduler.loading and not engine.scheduler._draining
    (a0, b0), (a1, b1) = runs["sync"], runs["async"]
    assert tokens(a0) == tokens(b0) == tokens(a1) == tokens(b1) and len(tokens(b1)) == 12
    assert cached(b0) == cached(b1) == 96


def test_others_run_while_a_prefix_loads_and_held_slots_are_not_reused():
    """While one request's 6 blocks load (copies_done says no for 6 polls), a running request keeps
    decoding and new prompts evict into the small tier; the loading request then matches a cold run."""
    ex = AsyncCopies(delay=6, num_kv_blocks=24, host_kv_blocks=12)
    engine = make_engine(ex, host_kv_blocks=12)
    first = submit(engine, GenerateRequest("a1", PROMPT, PARAMS))
    run_until_idle(engine)
    for i in range(4):                               # push some of PROMPT's blocks out to the tier
        submit(engine, GenerateRequest(f"o{i}", [200 + i] + list(range(1, 70)), PARAMS))
        run_until_idle(engine)
    busy = submit(engine, GenerateRequest("busy", [7] * 20, SamplingParams(temperature=0.0, max_tokens=40,
                                                                         ignore_eos=True)))
    engine.step()
    second = submit(engine, GenerateRequest("a2", PROMPT, PARAMS))
    engine.step()                                    # a2 admitted: its copies issued, it waits LOADING
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
    engine.block_manager.check_invariants(idle=True)


def test_a_request_aborted_while_loading_gives_its_blocks_back_after_the_copy():
    ex = AsyncCopies(delay=1000, num_kv_blocks=12, host_kv_blocks=64)   # lands only on wait_copies
    engine = make_engine(ex, host_kv_blocks=64)
    submit(engine, GenerateRequest("a1", PROMPT, PARAMS))
    run_until_idle(engine)
    for i in range(8):
        submit(engine, GenerateRequest(f"o{i}", [200 + i] + list(range(1, 70)), PARAMS))
        run_until_idle(engine)
    busy = submit(engine, GenerateRequest("busy", [9] * 20, SamplingParams(temperature=0.0, max_tokens=30,
                                                                         ignore_eos=True)))
    engine.step()
    events = submit(engine, GenerateRequest("a2", PROMPT, PARAMS))
    engine.step()
    seq = engine.scheduler.loading[0]
    blocks = list(seq.load.blocks)
    engine.abort("a2")
    engine.drain_inbox()
    engine.step()
    assert not engine.scheduler.loading and len(engine.scheduler._draining) == 1
    assert all(engine.block_manager.ref_counts[b] == 1 for b in blocks)   # still held: the copy writes them
    ticket = engine.scheduler._draining[0].ticket
    ex.wait_copies(ticket)
    engine.step()
    assert not engine.scheduler._draining
    assert all(engine.block_manager.ref_counts[b] == 0 for b in blocks)
    run_until_idle(engine)
    assert not [e for e in events if isinstance(e, Token)]
    assert len(tokens(busy)) == 30
    engine.block_manager.check_invariants(idle=True)
    assert engine.scheduler.host_tier._held == {}


def test_the_gpu_switch_reads_the_environment():
    from engine.executor.env import gpu_tuning_from_env

    assert gpu_tuning_from_env({}).async_restore is False
    assert gpu_tuning_from_env({"OPENINFER_ASYNC_RESTORE": "1"}).async_restore is True
