"""Two engine processes behind one DataParallelClient (CPU, tiny Qwen3): transformers' greedy tokens from
either replica, requests spread by load, a conversation's next turn served where its prefix is cached,
aborts reaching the replica that runs the request, LoRA adapters loaded and unloaded on every replica (a bad
one on none), the prefix-cache reset on all, the stats added up, and a replica named by the request."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.events import Finished, Rejected, Token
from engine.handle import collect_events
from engine.lora import LoRAError
from engine.process_replicas import DataParallelClient
from engine.request import GenerateRequest, SamplingParams
from harness.lora import hf_lora_logits, malformed_adapter, tiny_adapter_path
from harness.models import hf_logits, tiny_model_path
from memory.kv_pool import BLOCK_SIZE

pytestmark = pytest.mark.slow      # two engine processes start: ~15 s on 2 cores
MODEL = "qwen3_tied"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def dp():
    config = EngineConfig(model=tiny_model_path(MODEL), device="cpu", max_model_len=256, num_kv_blocks=64,
                          progress=False, enable_lora=True, max_loras=2, data_parallel_size=2)
    with DataParallelClient(config) as client:
        yield client


def oracle(prompt: list[int], steps: int, adapter: str | None = None) -> list[int]:
    """transformers' greedy tokens (with the peft adapter where named)."""
    path, ids = tiny_model_path(MODEL), list(prompt)
    for _ in range(steps):
        logits = hf_logits(path, ids) if adapter is None else hf_lora_logits(path, tiny_adapter_path(MODEL, adapter), ids)
        ids.append(int(np.argmax(logits[-1])))
    return ids[len(prompt):]


def run(dp, requests: list[GenerateRequest]) -> list:
    """Each request's RequestOutput, all submitted at once (in order) from one event loop."""
    async def go():
        streams = [dp.submit(r) for r in requests]

        async def drain(req, stream):
            return collect_events(req.request_id, list(req.prompt_token_ids), [e async for e in stream], req.params.n)
        return await asyncio.gather(*(drain(r, s) for r, s in zip(requests, streams)))
    return asyncio.run(go())


def request(rid: str, prompt: list[int], params: SamplingParams = GREEDY, **kw) -> GenerateRequest:
    return GenerateRequest(rid, prompt, params, **kw)


def test_either_replica_gives_transformers_greedy_tokens_and_requests_spread(dp):
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    before = list(dp.dispatched)
    outs = run(dp, [request(f"same-{i}", p) for i, p in enumerate(prompts)])
    assert [o.outputs[0].token_ids for o in outs] == [oracle(p, 6) for p in prompts]
    assert [a - b for a, b in zip(dp.dispatched, before)] == [2, 2]          # 4 at once: 2 each
    pinned = run(dp, [request(f"pinned-{r}", prompts[0], data_parallel_rank=r) for r in (0, 1)])
    assert [o.outputs[0].token_ids for o in pinned] == [oracle(prompts[0], 6)] * 2


def test_the_least_loaded_replica_takes_the_next_request(dp):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def go():
        busy = [dp.submit(request(f"busy-{i}", [40 + i, 41, 42], long, data_parallel_rank=0)) for i in range(3)]
        before = list(dp.dispatched)
        short = [dp.submit(request(f"short-{i}", [60 + i, 61, 62])) for i in range(2)]
        sent = [a - b for a, b in zip(dp.dispatched, before)]
        loads = [r.in_flight() for r in dp.replicas]
        for stream in busy + short:
            async for _ in stream:
                pass
        return sent, loads
    sent, loads = asyncio.run(go())
    assert sent == [0, 2] and loads == [3, 2]


def test_a_conversations_next_turn_is_served_where_its_prefix_is_cached(dp):
    system = list(range(100, 100 + 3 * BLOCK_SIZE))
    turns = [system + [7 + i] * BLOCK_SIZE for i in range(4)]              # 4 conversations' first turns
    firsts = run(dp, [request(f"turn1-{i}", t) for i, t in enumerate(turns)])
    seconds = [t + o.outputs[0].token_ids + [9] * 3 for t, o in zip(turns, firsts)]
    # in the other order: taking turns (or the least loaded alone) would send some to the other replica
    outs = run(dp, [request(f"turn2-{i}", seconds[i]) for i in reversed(range(4))])[::-1]
    assert all(o.cached_tokens >= len(t) // BLOCK_SIZE * BLOCK_SIZE for o, t in zip(outs, turns)), \
        [o.cached_tokens for o in outs]


def test_an_abort_reaches_the_replica_running_the_request(dp):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def go():
        streams = {r: dp.submit(request(f"abort-{r}", [3, 4, 5, r], long, data_parallel_rank=r)) for r in (0, 1)}
        events = {0: [], 1: []}
        async for e in streams[1]:
            events[1].append(e)
            if sum(isinstance(x, Token) for x in events[1]) == 3:
                dp.abort("abort-1")
        dp.abort("abort-0")
        async for e in streams[0]:
            events[0].append(e)
        return events
    events = asyncio.run(go())
    for r in (0, 1):
        assert isinstance(events[r][-1], Finished) and events[r][-1].reason == "abort"
        assert sum(isinstance(e, Token) for e in events[r]) < 200
    assert all(r.in_flight() == 0 for r in dp.replicas)


def test_lora_adapters_load_and_unload_on_every_replica(dp, tmp_path):
    prompt = [11, 12, 13, 14, 15]

    async def load_and_serve():
        await dp.load_lora_adapter("mlp", tiny_adapter_path(MODEL, "mlp4_rs"))
        assert dp.lora_adapters == {"mlp": tiny_adapter_path(MODEL, "mlp4_rs")}
        return await asyncio.gather(*(tokens(dp, request(f"lora-{r}", prompt, lora_name="mlp", data_parallel_rank=r))
                                      for r in (0, 1)))
    want = oracle(prompt, 6, "mlp4_rs")
    assert asyncio.run(load_and_serve()) == [want, want]

    async def unload():
        await dp.unload_lora_adapter("mlp")
        return [await first_event(dp, request(f"gone-{r}", prompt, lora_name="mlp", data_parallel_rank=r))
                for r in (0, 1)]
    assert all(isinstance(e, Rejected) and "mlp" in e.reason for e in asyncio.run(unload()))

    bad = malformed_adapter(tiny_adapter_path(MODEL, "attn8"), str(tmp_path / "bad"))
    with pytest.raises(LoRAError):
        asyncio.run(dp.load_lora_adapter("bad", bad))
    assert "bad" not in dp.lora_adapters
    assert all(r.stats().lora_adapters_loaded == 0 for r in dp.replicas)


async def tokens(dp, req: GenerateRequest) -> list[int]:
    return [e.token_id async for e in dp.submit(req) if isinstance(e, Token)]


async def first_event(dp, req: GenerateRequest):
    async for e in dp.submit(req):
        return e


def test_the_prefix_cache_reset_empties_every_replica(dp):
    prompt = list(range(300, 300 + 3 * BLOCK_SIZE))

    def cached(tag: str) -> list[int]:
        outs = run(dp, [request(f"{tag}-{r}", prompt, data_parallel_rank=r) for r in (0, 1)])
        return [o.cached_tokens for o in outs]
    cached("warm")
    assert all(c >= 2 * BLOCK_SIZE for c in cached("hit"))
    asyncio.run(dp.reset_prefix_cache())
    assert cached("after-reset") == [0, 0]


def test_stats_add_up_health_and_a_named_replica_out_of_range(dp):
    run(dp, [request("stats", [1, 2, 3])])
    per = dp.replica_stats()
    total = dp.stats()
    assert total.prompt_tokens_total == sum(s.prompt_tokens_total for s in per) > 0
    assert total.kv_blocks_total == 128 and all(s.kv_blocks_total == 64 for s in per)
    assert dp.is_healthy() and dp.data_parallel_size == 2
    with pytest.raises(ValueError, match=r"data_parallel_rank 2 is out of range \[0, 2\)"):
        run(dp, [request("far", [1, 2, 3], data_parallel_rank=2)])
    assert isinstance(run(dp, [request("after", [1, 2, 3])])[0].outputs[0].finish_reason, str)
