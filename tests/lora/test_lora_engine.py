"""LoRA through the engine on the CPU executor (tiny Qwen3, the PEFT adapters of harness/lora.py): a
request's adapter decodes as transformers + peft does, batches of several adapters (and more adapters
than slots) never change what a request generates, the prefix cache and the host KV tier never serve one
adapter's blocks to another, and run-time loads and unloads keep requests in flight intact."""
from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.events import Finished, Rejected, Scheduled, Token
from engine.handle import EngineHandle
from engine.limits import StepLimits
from engine.lora import LoRAError
from engine.request import GenerateRequest, SamplingParams
from fake_executor import make_engine, run_until_idle, submit
from harness.lora import TINY_ADAPTERS, hf_lora_logits, malformed_adapter, tiny_adapter_path
from harness.models import hf_logits, tiny_model_path
from memory.prefix_hash import hash_chain

MODEL = "qwen3_tied"
ADAPTERS = sorted(TINY_ADAPTERS)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def loaded():
    from engine.loader import load_model
    return load_model(tiny_model_path(MODEL))


def modules(names=ADAPTERS) -> tuple[tuple[str, str], ...]:
    return tuple((a, tiny_adapter_path(MODEL, a)) for a in names)


def lora_engine(max_loras: int = 3, num_kv_blocks: int = 64, host_kv_blocks: int = 0, lora_modules=None, **config):
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    model = loaded()
    ex = CpuExecutor(model, options_of(num_kv_blocks=num_kv_blocks, max_model_len=512, max_loras=max_loras,
                                       host_kv_blocks=host_kv_blocks))
    return make_engine(ex, model.tokenizer, enable_lora=True, lora_modules=lora_modules or modules(), max_loras=max_loras,
                       host_kv_blocks=host_kv_blocks, **config)


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, Token)]


def cached(events) -> int:
    return next(e.cached_tokens for e in events if isinstance(e, Scheduled))


def request(rid: str, prompt, lora: str | None, params=GREEDY) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), params, lora_name=lora)


def run(engine, reqs) -> list[list]:
    got = [submit(engine, r) for r in reqs]
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    return got


def oracle_greedy(prompt: list[int], adapter: str | None, steps: int = 8) -> list[int]:
    path, ids = tiny_model_path(MODEL), list(prompt)
    for _ in range(steps):
        logits = hf_logits(path, ids) if adapter is None else hf_lora_logits(path, tiny_adapter_path(MODEL, adapter), ids)
        ids.append(int(np.argmax(logits[-1])))
    return ids[len(prompt):]


PROMPTS = [[(37 * i + 11 * j) % 5000 + 100 for j in range(n)] for i, n in enumerate((7, 21, 40, 13))]


def test_each_adapter_decodes_as_peft_greedy():
    engine = lora_engine()
    for lora in ADAPTERS + [None]:
        (events,) = run(engine, [request(f"r-{lora}", PROMPTS[1], lora)])
        assert tokens(events) == oracle_greedy(PROMPTS[1], lora), lora


@pytest.mark.parametrize("max_loras", [3, 1])
def test_mixed_requests_equal_each_alone(max_loras):
    """Every adapter and the base model at once, twice each (prefill chunks and decodes in the same
    steps); with one slot the adapters take turns and swap in and out of it."""
    alone = {}
    for i, lora in enumerate(ADAPTERS + [None]):
        (alone[lora],) = run(lora_engine(max_loras), [request("a", PROMPTS[i], lora)])
    engine = lora_engine(max_loras, max_num_batched_tokens=32)
    seen = []
    real = engine.executor.execute
    engine.executor.execute = lambda batch: seen.append(batch.lora_slots) or real(batch)
    reqs = [request(f"m{k}-{lora}", PROMPTS[i], lora) for k in range(2) for i, lora in enumerate(ADAPTERS + [None])]
    got = run(engine, reqs)
    for r, events in zip(reqs, got):
        assert tokens(events) == tokens(alone[r.lora_name]), r.request_id
    slots_per_step = [len(set(s[s >= 0].tolist())) for s in seen if s is not None]
    assert max(slots_per_step) == max_loras
    # three slots: each adapter loaded once; one slot: each at least once, swapped in turn
    assert engine.loras.loads == 3 if max_loras == 3 else engine.loras.loads >= 3


def run_reading(engine, reqs) -> list[list]:
    """run() where requests may wait for their adapter's folder to be read again (a thread's answer
    reaches the engine through its inbox)."""
    got = [submit(engine, r) for r in reqs]
    while engine._fetching or engine.has_work():
        engine.drain_inbox(block=not engine.has_work())
        run_until_idle(engine)
        engine.loras.after_step()
    engine.block_manager.check_invariants(idle=True)
    return got


def test_adapters_out_of_host_memory_are_read_again():
    """--max-cpu-loras 1, three adapters: one kept in host memory, the others read again when a request
    names them (each request then decodes as peft does); all three in use at once exceed the bound
    until they end."""
    engine = lora_engine(max_loras=1, max_cpu_loras=1)
    assert len(engine.loras.host) == 1 and len(engine.loras.loaded) == 3
    kept = next(a for a in ADAPTERS if engine.loras.in_host(a))
    reads = []
    real_read = engine.loras.read
    engine.loras.read = lambda name, path: reads.append(name) or real_read(name, path)
    reqs = [request(f"h-{lora}", PROMPTS[i], lora) for i, lora in enumerate(ADAPTERS)]
    got = run_reading(engine, reqs)
    for i, (r, events) in enumerate(zip(reqs, got)):
        assert tokens(events) == oracle_greedy(PROMPTS[i], r.lora_name), r.request_id
    assert set(reads) >= set(ADAPTERS) - {kept} and len(engine.loras.host) == 1
    i, other = next((i, a) for i, a in enumerate(ADAPTERS) if not engine.loras.in_host(a))
    before = len(reads)
    (again,) = run_reading(engine, [request("again", PROMPTS[i], other)])
    assert tokens(again) == tokens(got[i]) and reads[before:] == [other]


def test_an_adapter_that_cannot_be_read_again_rejects_its_request(tmp_path):
    import shutil
    folder = str(tmp_path / "gone")
    shutil.copytree(tiny_adapter_path(MODEL, "attn8"), folder)
    engine = lora_engine(max_loras=1, max_cpu_loras=1, lora_modules=(("gone", folder),) + modules(["mixed16"]))
    assert len(engine.loras.host) == 1 and engine.loras.in_host("mixed16") and not engine.loras.in_host("gone")
    shutil.rmtree(folder)
    bad, good = run_reading(engine, [request("bad", PROMPTS[0], "gone"), request("good", PROMPTS[0], "mixed16")])
    assert isinstance(bad[0], Rejected) and "is not a folder" in bad[0].reason and bad[-1] is None
    assert tokens(good) == oracle_greedy(PROMPTS[0], "mixed16")


def test_an_adapter_is_in_use_while_a_sequence_waits_runs_or_loads():
    """A sequence whose host-tier restores are in flight (scheduler.loading) holds its adapter too: an unload
    or a host-memory trim then would leave its next step without the adapter."""
    engine = lora_engine(max_loras=1, max_cpu_loras=1)
    ids = [engine.loras.id_of(a) for a in ADAPTERS]
    seqs = [engine.admission.sequence(request(f"s{i}", PROMPTS[0], a), i) for i, a in enumerate(ADAPTERS)]
    engine.scheduler.waiting.append(seqs[0])
    engine.scheduler.running.append(seqs[1])
    engine.scheduler.loading.append(seqs[2])
    try:
        assert engine.loras.in_use() == set(ids)
    finally:
        engine.scheduler.waiting.remove(seqs[0])
        engine.scheduler.running.remove(seqs[1])
        engine.scheduler.loading.remove(seqs[2])


def test_abort_while_the_adapter_is_read():
    import threading
    engine = lora_engine(max_loras=1, max_cpu_loras=1)
    gate, real_read = threading.Event(), engine.loras.read
    engine.loras.read = lambda name, path: gate.wait(10) and real_read(name, path)
    waiting = next(a for a in ADAPTERS if not engine.loras.in_host(a))
    events = submit(engine, request("slow", PROMPTS[0], waiting))
    engine.abort("slow")
    engine.drain_inbox()
    assert [e.reason for e in events if isinstance(e, Finished)] == ["abort"] and events[-1] is None
    gate.set()
    while engine.loras.fetching:
        engine.drain_inbox(block=True)
    assert not engine.requests and not engine._fetching and engine.loras.in_host(waiting)


def test_prefix_cache_never_serves_one_adapters_blocks_to_another():
    engine = lora_engine()
    stored = []
    engine.block_manager.subscribe(stored.append)
    prompt = PROMPTS[2]                                      # 40 tokens: two full blocks to cache
    (a1,) = run(engine, [request("a1", prompt, "attn8")])
    (b1,) = run(engine, [request("b1", prompt, "mlp4_rs")])
    (base,) = run(engine, [request("base", prompt, None)])
    (a2,) = run(engine, [request("a2", prompt, "attn8")])
    assert cached(a1) == cached(b1) == cached(base) == 0 and cached(a2) == 32
    assert tokens(a2) == tokens(a1)
    (fresh_b,) = run(lora_engine(), [request("b", prompt, "mlp4_rs")])
    assert tokens(b1) == tokens(fresh_b) != tokens(a1)
    ids = {engine.loras.id_of(a) for a in ("attn8", "mlp4_rs")}
    assert {e.adapter_id for e in stored if e.token_ids[:16] == tuple(prompt[:16])} == ids | {0}


def test_host_tier_never_restores_one_adapters_blocks_to_another():
    """A prompt's blocks under adapter A evicted to the host tier: B's run of the same prompt restores
    none of them, A's does."""
    engine = lora_engine(num_kv_blocks=8, host_kv_blocks=16)
    tier = engine.scheduler.host_tier
    prompt = PROMPTS[2]
    (a1,) = run(engine, [request("a1", prompt, "attn8")])
    for i in range(3):                                       # push A's blocks out of the device pool
        run(engine, [request(f"o{i}", [300 + i] + PROMPTS[3] * 4, None)])
    a_hashes = hash_chain(prompt[:32], 16, engine.loras.id_of("attn8"))
    assert engine.block_manager.lookup(a_hashes) == [] and len(tier.lookup(a_hashes)) == 2
    (b1,) = run(engine, [request("b1", prompt, "mlp4_rs")])
    assert cached(b1) == 0 and tier.slots.restored_blocks == 0
    (a2,) = run(engine, [request("a2", prompt, "attn8")])
    assert cached(a2) == 32 and tier.slots.restored_blocks == 2 and tokens(a2) == tokens(a1)


def test_scheduler_passes_over_an_adapter_that_cannot_join():
    """max_loras 1: while adapter 1 runs, a request of adapter 2 waits (keeping its place) and the base
    request and another of adapter 1 behind it join; once adapter 1's sequences are gone, adapter 2 runs."""
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from memory.block_manager import BlockManager

    sched = Scheduler(BlockManager(64), StepLimits(512, max_num_seqs=8, max_num_batched_tokens=256), max_loras=1)

    def seq(i: int, lora: int) -> Sequence:
        return Sequence(seq_id=i, request_id=f"r{i}", token_ids=[1, 2, 3], prompt_len=3, params=GREEDY, lora_id=lora)

    a, b, base, a2 = seq(1, 1), seq(2, 2), seq(3, 0), seq(4, 1)
    for s in (a, b, base, a2):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == [1, 3, 4] and list(sched.waiting) == [b]
    assert sched._admission_closed()                 # b cannot join: a decode step may be planned ahead
    for s in (a, a2):
        sched.finish(s)
    assert [s.seq_id for s in sched.schedule().seqs] == [3, 2]


def test_stats_name_the_running_and_waiting_adapters():
    """EngineStats (/metrics' lora_requests_info): with one slot, the first adapter's request runs while the
    second's waits; the base request names no adapter; afterwards nothing runs or waits."""
    engine = lora_engine(max_loras=1)
    a, b = ADAPTERS[:2]
    for r in (request("ra", PROMPTS[0], a), request("rb", PROMPTS[1], b), request("base", PROMPTS[2], None)):
        submit(engine, r)
    engine.drain_inbox()
    engine.step()
    st = engine.stats()
    assert (st.lora_running_adapters, st.lora_waiting_adapters) == (a, b)
    assert (st.lora_max_adapters, st.lora_adapters_loaded, st.lora_adapters_resident) == (1, len(ADAPTERS), 1)
    run_until_idle(engine)
    st = engine.stats()
    assert (st.lora_running_adapters, st.lora_waiting_adapters) == ("", "")
    assert st.lora_slot_loads == engine.loras.loads == 2


def test_unknown_adapter_and_lora_off_are_rejected():
    engine = lora_engine()
    (events,) = run(engine, [request("x", PROMPTS[0], "nope")])
    assert isinstance(events[0], Rejected) and "no LoRA adapter of that name" in events[0].reason


def test_more_adapters_than_lora_slots_is_refused_at_start():
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    ex = CpuExecutor(loaded(), options_of(num_kv_blocks=16, max_model_len=512, max_loras=1))
    with pytest.raises(ValueError, match="max_loras=2: the executor holds 1 LoRA slots"):
        make_engine(ex, loaded().tokenizer, enable_lora=True, max_loras=2)
    with pytest.raises(ValueError, match="--lora-modules: LoRA adapter 'bad'.*is not a folder"):
        make_engine(ex, loaded().tokenizer, enable_lora=True, lora_modules=(("bad", "/nowhere"),))


# ---- run-time loads and unloads on the threaded engine ---------------------------------------------
@pytest.fixture()
def handle():
    h = EngineHandle(EngineConfig(model=tiny_model_path(MODEL), device="cpu", num_kv_blocks=64, max_model_len=512,
                                  enable_lora=True, lora_modules=modules(["attn8"]), max_loras=2, progress=False))
    yield h
    h.shutdown()


async def collect(h, req) -> list:
    return [e async for e in h.submit(req)]


def test_load_use_and_unload_at_run_time(handle):
    async def main():
        with pytest.raises(LoRAError, match="already loaded"):
            await handle.load_lora_adapter("attn8", tiny_adapter_path(MODEL, "attn8"))
        with pytest.raises(LoRAError, match="is not a folder") as bad:
            await handle.load_lora_adapter("broken", "/nowhere/at/all")
        assert bad.value.status == 400 and "broken" not in handle.lora_adapters
        await handle.load_lora_adapter("late", tiny_adapter_path(MODEL, "mixed16"))
        assert set(handle.lora_adapters) == {"attn8", "late"}
        got = await collect(handle, request("l1", PROMPTS[1], "late"))
        assert tokens(got) == oracle_greedy(PROMPTS[1], "mixed16")
        await handle.unload_lora_adapter("late")
        after = await collect(handle, request("l2", PROMPTS[1], "late"))
        assert isinstance(after[0], Rejected)
        with pytest.raises(LoRAError) as gone:
            await handle.unload_lora_adapter("late")
        assert gone.value.status == 404
        # the name again, another adapter: its own id, so nothing of the first one's cache is served
        await handle.load_lora_adapter("late", tiny_adapter_path(MODEL, "mlp4_rs"))
        again = await collect(handle, request("l3", PROMPTS[1], "late"))
        assert cached(again) == 0 and tokens(again) == oracle_greedy(PROMPTS[1], "mlp4_rs")
    asyncio.run(main())


def test_unload_waits_for_the_requests_that_use_it(handle):
    """An unload while a request decodes with the adapter answers once that request is done; the
    request generates exactly what it does undisturbed; the name is refused from the unload on."""
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)

    async def main():
        undisturbed = await collect(handle, request("u0", PROMPTS[2], "attn8", params))
        stream = handle.submit(request("u1", PROMPTS[2], "attn8", params))
        first = await stream.__anext__()
        unload = asyncio.create_task(handle.unload_lora_adapter("attn8"))
        while "attn8" in handle.engine.loras.ids:
            await asyncio.sleep(0.001)
        refused = await collect(handle, request("u2", PROMPTS[0], "attn8"))
        assert not unload.done()
        rest = [e async for e in stream]
        await asyncio.wait_for(unload, 10)
        assert isinstance(refused[0], Rejected)
        assert tokens([first] + rest) == tokens(undisturbed) and len(tokens(undisturbed)) == 120
        assert handle.engine.loras.loaded == {} and "attn8" not in handle.lora_adapters
    asyncio.run(main())


def test_load_in_place_replaces_the_adapter_for_new_requests_only(handle):
    """vLLM's load_inplace: a request decoding with the adapter when it is replaced generates what it does
    undisturbed (the old weights); requests from then on use the new adapter, with none of the old one's
    cached blocks; the old adapter's slot is freed once its request ends."""
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)

    async def main():
        undisturbed = await collect(handle, request("r0", PROMPTS[2], "attn8", params))
        old_id = handle.engine.loras.ids["attn8"]
        stream = handle.submit(request("r1", PROMPTS[2], "attn8", params))
        first = await stream.__anext__()
        await handle.load_lora_adapter("attn8", tiny_adapter_path(MODEL, "mixed16"), in_place=True)
        assert handle.engine.loras.ids["attn8"] != old_id and old_id in handle.engine.loras.unloading
        new = await collect(handle, request("r2", PROMPTS[2], "attn8"))
        rest = [e async for e in stream]
        assert tokens([first] + rest) == tokens(undisturbed) and len(tokens(undisturbed)) == 120
        assert cached(new) == 0 and tokens(new) == oracle_greedy(PROMPTS[2], "mixed16")
        for _ in range(1000):                      # the old adapter drains after its request's last step
            if old_id not in handle.engine.loras.loaded:
                break
            await asyncio.sleep(0.001)
        assert old_id not in handle.engine.loras.loaded and old_id not in handle.engine.loras.unloading
        assert handle.lora_adapters["attn8"] == tiny_adapter_path(MODEL, "mixed16")
        # in place on a name not loaded is a plain load; a bad folder leaves the loaded adapter serving
        await handle.load_lora_adapter("fresh", tiny_adapter_path(MODEL, "mlp4_rs"), in_place=True)
        with pytest.raises(LoRAError, match="is not a folder"):
            await handle.load_lora_adapter("attn8", "/nowhere", in_place=True)
        again = await collect(handle, request("r3", PROMPTS[1], "attn8"))
        assert tokens(again) == oracle_greedy(PROMPTS[1], "mixed16")
    asyncio.run(main())


def test_every_failure_of_an_op_is_answered(handle, tmp_path, monkeypatch):
    """A malformed adapter file is a 400 naming the problem; an unexpected error in any part of an op
    (reading on its thread, registering or unloading on the engine thread, the prefix-cache reset) is a 500
    naming the op; none leaves the caller waiting, and the engine goes on serving."""
    from engine.engine_calls import EngineCallError
    bad = malformed_adapter(tiny_adapter_path(MODEL, "mixed16"), tmp_path / "bad")
    registry, engine = handle.engine.loras, handle.engine

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    async def answer(coro):
        with pytest.raises((LoRAError, EngineCallError)) as err:
            await asyncio.wait_for(coro, 30)
        return err.value.status, str(err.value)

    async def main():
        status, message = await answer(handle.load_lora_adapter("bad", bad))
        assert status == 400 and "'data_offsets' None is not [begin, end]" in message and bad in message
        for target, method, call, what in [
                (registry, "read", handle.load_lora_adapter("r", bad), f"loading LoRA adapter 'r' from {bad}"),
                (registry, "add", handle.load_lora_adapter("a", tiny_adapter_path(MODEL, "mixed16")),
                 "loading LoRA adapter 'a'"),
                (registry, "remove", handle.unload_lora_adapter("attn8"), "unloading LoRA adapter 'attn8'"),
                (engine, "reset_prefix_cache", handle.reset_prefix_cache(), "the prefix cache reset")]:
            with monkeypatch.context() as m:
                m.setattr(target, method, boom)
                status, message = await answer(call)
            assert status == 500 and message.startswith(what) and "RuntimeError: disk on fire" in message, message
        assert set(handle.lora_adapters) == {"attn8"} and set(registry.ids) == {"attn8"}
        got = await collect(handle, request("after", PROMPTS[1], "attn8"))
        assert tokens(got) == oracle_greedy(PROMPTS[1], "attn8")
    asyncio.run(main())


def test_ops_on_a_stopped_engine_are_answered():
    h = EngineHandle(EngineConfig(model=tiny_model_path(MODEL), device="cpu", num_kv_blocks=16, max_model_len=128,
                                  enable_lora=True, progress=False))
    h.shutdown()
    from engine.engine_calls import EngineCallError

    async def main():
        for call in (h.load_lora_adapter("x", tiny_adapter_path(MODEL, "attn8")), h.reset_prefix_cache()):
            with pytest.raises(EngineCallError, match="the engine is not running"):
                await asyncio.wait_for(call, 10)
    asyncio.run(main())


def test_engine_process_loads_and_unloads(tmp_path):
    """The same calls on the engine in a process of its own (answers over its pipe)."""
    from engine.process import EngineClient
    config = EngineConfig(model=tiny_model_path(MODEL), device="cpu", num_kv_blocks=32, max_model_len=256,
                          enable_lora=True, max_loras=1, progress=False)
    bad = malformed_adapter(tiny_adapter_path(MODEL, "mixed16"), tmp_path / "bad")
    client = EngineClient(config)
    try:
        async def main():
            await client.load_lora_adapter("m", tiny_adapter_path(MODEL, "mixed16"))
            got = await collect(client, request("p1", PROMPTS[0], "m"))
            with pytest.raises(LoRAError, match="is not a folder"):
                await client.load_lora_adapter("x", "/nowhere")
            with pytest.raises(LoRAError, match=r"'data_offsets' None is not \[begin, end\]"):
                await asyncio.wait_for(client.load_lora_adapter("x", bad), 30)
            await client.unload_lora_adapter("m")
            with pytest.raises(LoRAError) as gone:
                await client.unload_lora_adapter("m")
            return got, gone.value.status
        got, status = asyncio.run(main())
        assert tokens(got) == oracle_greedy(PROMPTS[0], "mixed16") and status == 404
    finally:
        client.shutdown()
