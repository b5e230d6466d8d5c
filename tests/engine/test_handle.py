"""EngineHandle: the async TokenEvent stream across the engine thread, abort, the blocking
generate, stats, rejection, shutdown (fake model; real models in test_handle_models.py)."""
import asyncio
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.events import Finished, Rejected, Scheduled, Token
from engine.handle import EngineHandle
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, FakeTokenizer


class SlowExecutor(FakeExecutor):
    def execute(self, batch):
        time.sleep(0.005)
        return super().execute(batch)


@pytest.fixture
def handle():
    h = EngineHandle(EngineConfig(max_num_batched_tokens=64), executor=SlowExecutor(),
                     tokenizer=FakeTokenizer(), model_name="fake", max_model_len=512)
    yield h
    h.shutdown()


def wait_idle(h, timeout=5.0):
    """Until the engine has taken every message, holds no request and no KV block (seen three
    times in a row, so a message still being handled is not mistaken for idleness)."""
    end, quiet = time.time() + timeout, 0
    e = h.engine
    while time.time() < end:
        idle = e._inbox.empty() and not e.requests and e.block_manager.num_used_blocks == 0
        quiet = quiet + 1 if idle else 0
        if quiet == 3 and h.stats().kv_blocks_used == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {h.stats()}")


async def collect(h, r):
    return [e async for e in h.submit(r)]


def test_stream_order_and_end(handle):
    r = GenerateRequest("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    events = asyncio.run(collect(handle, r))
    assert isinstance(events[0], Scheduled)
    assert [type(e) for e in events[1:]] == [Token] * 5 + [Finished]
    assert events[-1].usage.prompt_tokens == 3 and events[-1].usage.completion_tokens == 5
    assert handle.model_name == "fake" and handle.max_model_len == 512


def test_concurrent_streams_match_sequential(handle):
    reqs = [GenerateRequest(f"r{i}", [i + 1] * (i + 3), SamplingParams(temperature=0, max_tokens=8,
                            ignore_eos=True)) for i in range(6)]

    async def all_at_once():
        return await asyncio.gather(*(collect(handle, r) for r in reqs))

    together = asyncio.run(all_at_once())
    wait_idle(handle)
    for r, events in zip(reqs, together):
        r.request_id += "-again"
        again = asyncio.run(collect(handle, r))
        tok = lambda ev: [e.token_id for e in ev if isinstance(e, Token)]  # noqa: E731
        assert tok(events) == tok(again) and len(tok(events)) == 8


def test_abort_mid_generation_frees_everything(handle):
    async def go():
        stream = handle.submit(GenerateRequest("a", list(range(40)), SamplingParams(
            max_tokens=400, ignore_eos=True)))
        seen = []
        async for e in stream:
            seen.append(e)
            if sum(isinstance(x, Token) for x in seen) == 3:
                handle.abort("a")
        return seen

    events = asyncio.run(go())
    assert isinstance(events[-1], Finished) and events[-1].reason == "abort"
    assert 3 <= events[-1].usage.completion_tokens < 400
    wait_idle(handle)
    handle.engine.block_manager.check_invariants(idle=True)


def test_aclose_aborts(handle):
    async def go():
        stream = handle.submit(GenerateRequest("a", [5] * 20, SamplingParams(max_tokens=400, ignore_eos=True)))
        async for e in stream:
            if isinstance(e, Token):
                break
        await stream.aclose()

    asyncio.run(go())
    wait_idle(handle)
    assert handle.stats().kv_blocks_used == 0


def test_streams_from_several_event_loops(handle):
    results = {}

    def worker(i):
        r = GenerateRequest(f"t{i}", [i + 1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        results[i] = asyncio.run(collect(handle, r))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(results[i][-1], Finished) for i in range(4))


def test_rejected_stream(handle):
    events = asyncio.run(collect(handle, GenerateRequest("a", [1] * 500, SamplingParams(max_tokens=100))))
    assert len(events) == 1 and isinstance(events[0], Rejected)
    assert "max_model_len (512)" in events[0].reason


def test_generate_blocking_with_text_and_n(handle):
    outs = handle.generate(["héllo", [1, 2, 3]], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=6,
                                                                 logprobs=1, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == [list("héllo".encode()), [1, 2, 3]]
    for o in outs:
        assert o.error is None and len(o.outputs) == 2
        for s in o.outputs:
            assert len(s.token_ids) == 6 and s.finish_reason == "length"
            assert s.text == handle.tokenizer.decode(s.token_ids)
            assert all(lp is not None and len(top) == 1 for lp, top in zip(s.logprobs, s.top_logprobs))
    again = handle.generate(["héllo"], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=6,
                                                      ignore_eos=True))
    assert [s.token_ids for s in again[0].outputs] == [s.token_ids for s in outs[0].outputs]
    bad = handle.generate([[]], SamplingParams())
    assert bad[0].error and "empty" in bad[0].error


def test_stats_count_tokens(handle):
    before = handle.stats()
    handle.generate([[1] * 20], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    wait_idle(handle)
    after = handle.stats()
    assert after.prompt_tokens_total - before.prompt_tokens_total == 20
    assert after.generation_tokens_total - before.generation_tokens_total == 7
    assert after.kv_blocks_total == 64 and after.num_running == after.num_waiting == 0


def test_shutdown_rejects_new_work():
    h = EngineHandle(executor=FakeExecutor(), tokenizer=FakeTokenizer())
    assert h.is_healthy()
    h.shutdown()
    assert not h.is_healthy()

    async def go():
        h.submit(GenerateRequest("a", [1], SamplingParams()))

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(go())


def test_internal_error_fails_requests_and_engine_keeps_serving(handle):
    real = handle.engine.scheduler.schedule
    calls = []

    def broken():
        if not calls:
            calls.append(1)
            raise RuntimeError("scheduler bug")
        return real()

    handle.engine.scheduler.schedule = broken
    events = asyncio.run(collect(handle, GenerateRequest("a", [1, 2], SamplingParams(max_tokens=3))))
    assert type(events[-1]).__name__ == "Error" and "scheduler bug" in events[-1].message
    events = asyncio.run(collect(handle, GenerateRequest("b", [1, 2], SamplingParams(max_tokens=3))))
    assert isinstance(events[-1], Finished)
    wait_idle(handle)


def test_kv_events_reach_a_subscriber(handle):
    from memory.block_manager import BlockStored
    from memory.prefix_hash import hash_chain
    seen = []
    handle.subscribe_kv_events(seen.append)
    prompt = list(range(1, 40))
    handle.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    stored = [e.block_hash for e in seen if isinstance(e, BlockStored)]
    assert stored == hash_chain(prompt, 16)             # the prompt's two full blocks


def test_closed_event_loop_aborts_its_requests(handle):
    loop = asyncio.new_event_loop()

    async def start():
        return handle.submit(GenerateRequest("orphan", [3] * 30, SamplingParams(max_tokens=400, ignore_eos=True)))

    loop.run_until_complete(start())
    loop.close()
    wait_idle(handle)
    assert handle.stats().generation_tokens_total < 400
    handle.engine.block_manager.check_invariants(idle=True)
