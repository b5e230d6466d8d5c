"""The host KV tier: prefix-cache blocks the device pool evicts are kept in host memory and copied
back for a later hit. Its bookkeeping on its own, then the engine with a KV pool too small to keep
a prompt's prefix: the second run of that prompt must hit in the tier, restore the blocks and
generate exactly what it generated the first time (the fake model reads its whole context back
through the block table, so a wrong or missing restore changes its output), on the fake model and
on a real tiny model through the CPU executor."""
from __future__ import annotations

import pytest

from engine.events import Scheduled, Token
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit
from memory.host_tier import HostKVTier


def test_tier_bookkeeping():
    tier = HostKVTier(2)
    tier.store(11, device_block=5)
    tier.store(12, device_block=6)
    assert tier.lookup([11, 12, 13]) == [0, 1] and tier.end_step() == ([(5, 0), (6, 1)], [])
    tier.store(11, device_block=9)                  # already held: no copy, refreshed in the LRU
    assert tier.end_step() == ([], [])
    tier.store(13, device_block=7)                  # full: the least recently used (12) goes
    assert tier.lookup([12]) == [] and tier.lookup([13]) == [1]
    tier.end_step()
    tier.restore(13, 1, device_block=3)             # pinned for this step: 11 is evicted instead
    tier.store(14, device_block=8)
    assert tier.lookup([13]) == [1] and tier.lookup([11]) == [] and tier.lookup([14]) == [0]
    assert tier.end_step() == ([(8, 0)], [(1, 3)])
    tier.pin([0, 1])
    tier.store(15, device_block=2)                  # every slot pinned: dropped, nothing copied
    assert tier.lookup([15]) == [] and tier.end_step() == ([], [])
    with pytest.raises(ValueError):
        HostKVTier(0)


def prompt_then_evict_then_again(engine, prompt, params, others=8, settle=lambda: None):
    """Run `prompt`, then enough other long prompts to push its blocks out of the device pool, then
    `prompt` again; returns the two runs' events. settle: lands copies still in flight before the
    idle checks (an executor with asynchronous copies)."""
    first = submit(engine, GenerateRequest("a1", prompt, params))
    run_until_idle(engine)
    for i in range(others):
        submit(engine, GenerateRequest(f"o{i}", [200 + i] + list(range(1, 70)), params))
        run_until_idle(engine)
    second = submit(engine, GenerateRequest("a2", prompt, params))
    run_until_idle(engine)
    settle()
    engine.block_manager.check_invariants(idle=True)
    return first, second


def tokens(events):
    return [e.token_id for e in events if isinstance(e, Token)]


def cached(events):
    return next(e.cached_tokens for e in events if isinstance(e, Scheduled))


@pytest.mark.parametrize("tier_blocks", [0, 64])
def test_evicted_prefix_comes_back_from_the_host_tier(tier_blocks):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(30, 130))                   # 100 tokens: 6 full blocks to reuse
    engine = make_engine(FakeExecutor(num_kv_blocks=12, host_kv_blocks=tier_blocks), host_kv_blocks=tier_blocks)
    first, second = prompt_then_evict_then_again(engine, prompt, params)
    assert tokens(second) == tokens(first) and len(tokens(first)) == 12
    tier = engine.scheduler.host_tier
    if tier_blocks:
        assert cached(second) == 96 and tier.slots.restored_blocks == 6 and tier.slots.stored_blocks >= 6
        stats = engine.stats()
        assert stats.host_kv_restored_blocks == 6 and stats.host_kv_stored_blocks == tier.slots.stored_blocks
    else:
        assert tier is None and cached(second) == 0          # the device pool alone lost the prefix


def test_host_tier_on_a_real_model_cpu_executor():
    from test_handle_models import loaded

    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    model = loaded("qwen3_gqa4")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(70)]
    runs = {}
    for tier_blocks in (0, 32):
        ex = CpuExecutor(model, options_of(num_kv_blocks=10, max_model_len=512, host_kv_blocks=tier_blocks))
        engine = make_engine(ex, model.tokenizer, max_model_len=512, host_kv_blocks=tier_blocks)
        runs[tier_blocks] = prompt_then_evict_then_again(engine, prompt, params, others=4)
        if tier_blocks:
            stats = engine.stats()
    (a0, b0), (a1, b1) = runs[0], runs[32]
    assert tokens(a0) == tokens(b0) == tokens(a1) == tokens(b1)
    assert cached(b1) == 64 and cached(b0) == 0
    # the metrics: hits by tier and the bytes both ways (float32 K and V of every layer's KV heads)
    layout = model.model.kv_layout()
    block_bytes = 16 * layout.layers * layout.planes * layout.heads * layout.dim * 4
    assert stats.prefix_cache_host_hits == 64 and stats.prefix_cache_hits >= 64
    assert stats.host_kv_restore_bytes == 4 * block_bytes
    assert stats.host_kv_offload_bytes == stats.host_kv_stored_blocks * block_bytes > 0
    assert stats.host_kv_copy_seconds > 0


def test_host_tier_needs_an_executor_that_copies():
    class NoCopy(FakeExecutor):
        supports_host_tier = False

    with pytest.raises(ValueError, match="host KV tier"):
        make_engine(NoCopy(host_kv_blocks=4), host_kv_blocks=4)
    with pytest.raises(ValueError, match="holds 2 host KV slots"):
        make_engine(FakeExecutor(host_kv_blocks=2), host_kv_blocks=4)


@pytest.mark.parametrize("model", ["fake", "qwen3_gqa4"])
def test_pure_host_mode_serves_a_repeat_from_the_host_tier(model):
    """Prefix caching off with a host tier: the device keeps no prefix, a finished sequence's full blocks go
    to the host, and the same prompt later restores them: the tokens of a cold run, 64 or 96 tokens cached,
    and nothing hit on the device. The fake model reads its whole context through the block table, so a
    wrong or missing restore changes its output."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    if model == "fake":
        ex, tokenizer, prompt, full = FakeExecutor(num_kv_blocks=40, host_kv_blocks=32), None, list(range(30, 130)), 96
    else:
        from test_handle_models import loaded

        from engine.executor.cpu import CpuExecutor
        from engine.executor.options import options_of
        m = loaded(model)
        ex = CpuExecutor(m, options_of(num_kv_blocks=40, max_model_len=512, host_kv_blocks=32))
        tokenizer, prompt, full = m.tokenizer, [(7 * i + 3) % 200 + 10 for i in range(70)], 64
    engine = make_engine(ex, tokenizer, max_model_len=512, host_kv_blocks=32, enable_prefix_caching=False)
    first = submit(engine, GenerateRequest("a1", prompt, params))
    run_until_idle(engine)
    second = submit(engine, GenerateRequest("a2", prompt, params))
    run_until_idle(engine)
    tier = engine.scheduler.host_tier
    assert tokens(second) == tokens(first) and len(tokens(first)) == 10
    assert cached(first) == 0 and cached(second) == full and tier.slots.restored_blocks == full // 16
    assert not engine.block_manager.cached                       # the device cached nothing
    engine.block_manager.check_invariants(idle=True)


def test_reset_prefix_cache_moves_the_device_prefix_to_the_host_tier():
    """With a host tier, the reset offloads the evicted blocks at once (not with the next step), and the
    same prompt then hits them from the host tier with the tokens of the first run."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(30, 130))                   # 6 full blocks
    ex = FakeExecutor(num_kv_blocks=40, host_kv_blocks=16)
    engine = make_engine(ex, host_kv_blocks=16)
    first = submit(engine, GenerateRequest("a1", prompt, params))
    run_until_idle(engine)
    assert engine.reset_prefix_cache() >= 6
    assert engine.stats().host_kv_stored_blocks >= 6 and engine.block_manager.num_used_blocks == 0
    # the device blocks are reused by someone else before the repeat comes: only an offload made by
    # the reset itself (not one deferred to the next step) still holds the prompt's KV
    ex.kv[:] = 7
    second = submit(engine, GenerateRequest("a2", prompt, params))
    run_until_idle(engine)
    assert tokens(second) == tokens(first) and cached(second) == 96
    assert engine.stats().prefix_cache_host_hits == 96


@pytest.mark.parametrize("pool_order", ["ascending", "descending"])
def test_a_prompts_blocks_move_as_one_copy_each_way(pool_order):
    """A prompt's blocks, evicted tail first by the reset, land in consecutive slots in prefix order and
    come back into consecutive device blocks: the copier merges each direction into one run (one copy),
    not one copy per block, in whichever direction the pool hands its blocks out."""
    from memory.host_kv_copy import by_destination, copy_runs

    class Recording(FakeExecutor):
        def copy_blocks(self, offloads, restores):
            self.calls.append((list(offloads), list(restores)))
            super().copy_blocks(offloads, restores)

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(30, 30 + 16 * 8 + 5))       # 8 full blocks
    ex = Recording(num_kv_blocks=64, host_kv_blocks=32)
    ex.calls = []
    engine = make_engine(ex, host_kv_blocks=32)
    if pool_order == "descending":                  # the pool hands its blocks out in descending order
        engine.block_manager._free.reverse()
    first = submit(engine, GenerateRequest("a1", prompt, params))
    run_until_idle(engine)
    engine.reset_prefix_cache()
    ex.kv[:] = 7
    second = submit(engine, GenerateRequest("a2", prompt, params))
    run_until_idle(engine)
    assert tokens(second) == tokens(first) and cached(second) == 128
    offloads = [p for o, _ in ex.calls for p in o]
    restores = [p for _, r in ex.calls for p in r]
    assert len(offloads) == len(restores) == 8
    runs = lambda pairs, a, b: copy_runs(by_destination(pairs), 64, 64, "x", a, b)
    assert len(runs(offloads, "device block", "host slot")) == 1
    assert len(runs(restores, "host slot", "device block")) == 1


def test_the_reset_answers_once_its_offload_has_landed():
    """POST /reset_prefix_cache's op: the eviction and the offload run on the engine thread, and the answer
    waits for the executor's copy fence (a request right after the reset then waits for no D2H copy)."""
    import threading
    import types

    from engine.engine_calls import run_engine_op

    landed, answers, calls = threading.Event(), [], []
    engine = types.SimpleNamespace(
        call=lambda fn: fn(), reset_prefix_cache=lambda: calls.append("reset"),
        executor=types.SimpleNamespace(copy_fence=lambda: (calls.append("fence"), landed.wait)[1]))
    done = threading.Event()
    run_engine_op(engine, ("reset_prefix_cache",), lambda err: (answers.append(err), done.set()))
    assert calls == ["reset", "fence"]
    assert not done.wait(0.2) and answers == []          # the copies have not landed: no answer yet
    landed.set()
    assert done.wait(5) and answers == [None]
