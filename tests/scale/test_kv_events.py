"""KV cache events in vLLM's format (engine/kv_events.py, engine/kv_event_publisher.py), on the fake model's
engine driven by hand: every batch is received by a ZMQ subscriber and decoded with vLLM's own schema
(tests/kv_event_subscriber.py). The hashes published must be the engine's own prefix hashes (memory/
prefix_hash.py: the chain a router keys blocks by), the tokens those of the blocks, and each event must say
what happened to the cache: stored as a prompt's blocks fill, removed as the pool evicts them, moved to the
host tier (medium "CPU") and dropped from it, all cleared by a reset that leaves nothing cached."""
from __future__ import annotations

import argparse
import sys
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from engine.kv_events import KVEventsConfig
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit
from kv_event_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, events_config
from memory.kv_pool import BLOCK_SIZE
from memory.prefix_hash import hash_chain
from test_server_cli import free_port

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture
def events():
    """(make(executor, **config) -> engine publishing its events, the Subscriber of the last one made)."""
    made = []

    def make(executor=None, **config):
        port, replay = free_port(), free_port()
        engine = make_engine(executor or FakeExecutor(),
                             kv_events_config=KVEventsConfig(**events_config(port, replay)), **config)
        made.append((engine, Subscriber(port, replay_port=replay)))
        return engine, made[-1][1]
    yield make
    for engine, sub in made:
        engine.kv_events.close(0.0)
        sub.close()


def run(engine, rid: str, prompt: list[int], params: SamplingParams = ONE_TOKEN) -> None:
    submit(engine, GenerateRequest(rid, prompt, params))
    run_until_idle(engine)


def stored(evs, medium="GPU") -> list[BlockStored]:
    return [e for e in evs if isinstance(e, BlockStored) and e.medium == medium]


def removed(evs, medium="GPU") -> list[int]:
    return [h for e in evs if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


def test_a_prompts_full_blocks_are_stored_as_one_chain(events):
    engine, sub = events()
    prompt = list(range(1, 71))                                # 4 full blocks and 6 tokens
    run(engine, "a", prompt)
    chain = hash_chain(prompt, BLOCK_SIZE)
    (event,) = [e for _, batch in sub.wait(lambda evs: stored(evs)) for e in batch.events]
    assert event == BlockStored(block_hashes=chain, parent_block_hash=None, token_ids=prompt[:64], block_size=16,
                                lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * 4, group_idx=0)
    # a prompt sharing the first two blocks stores only its own, under the second block as parent
    other = prompt[:32] + list(range(200, 240))
    run(engine, "b", other)
    (event,) = stored(e for _, batch in sub.wait(lambda evs: len(stored(evs)) == 2)[-1:] for e in batch.events)
    assert event.parent_block_hash == chain[1] and event.block_hashes == hash_chain(other, BLOCK_SIZE)[2:]
    assert event.token_ids == other[32:64]
    seqs = [seq for seq, _ in sub.received]
    assert seqs == list(range(len(seqs))) and all(b.data_parallel_rank == 0 for _, b in sub.received)


def test_a_lora_requests_blocks_name_their_adapter():
    """vLLM's fields for a LoRA request's blocks (a tiny model, a PEFT adapter): lora_id the adapter's id,
    lora_name its name, and the name as each block's extra key (what its hash covers beyond the tokens)."""
    from test_lora_engine import ADAPTERS, lora_engine
    port = free_port()
    engine = lora_engine(kv_events_config=KVEventsConfig(**events_config(port)))
    sub = Subscriber(port)
    try:
        prompt, name = list(range(1, 40)), ADAPTERS[0]
        for rid, lora in (("base", None), ("lora", name)):
            submit(engine, GenerateRequest(rid, prompt, ONE_TOKEN, lora_name=lora))
            run_until_idle(engine)
        base, tuned = stored(e for _, b in sub.wait(lambda evs: len(stored(evs)) == 2) for e in b.events)
        lora_id = engine.loras.id_of(name)
        assert (base.block_hashes, base.lora_id, base.lora_name, base.extra_keys) == (
            hash_chain(prompt, BLOCK_SIZE), None, None, [None, None])
        assert (tuned.block_hashes, tuned.lora_id, tuned.lora_name, tuned.extra_keys) == (
            hash_chain(prompt, BLOCK_SIZE, lora_id), lora_id, name, [(name,), (name,)])
        assert tuned.token_ids == base.token_ids == prompt[:32]
    finally:
        engine.kv_events.close(0.0)
        sub.close()


def test_evicted_blocks_are_removed_one_event_each(events):
    engine, sub = events(FakeExecutor(num_kv_blocks=10))
    first = list(range(1, 66))                                 # 4 full blocks (+1 for its tail)
    run(engine, "a", first)
    for i in range(3):                                         # 3 more prompts of 5 blocks each: LRU evicts it
        run(engine, f"o{i}", [100 + i] + list(range(150, 214)))
    chain = hash_chain(first, BLOCK_SIZE)
    sub.wait(lambda evs: set(chain) <= set(removed(evs)))
    gone = [e for e in sub.events() if isinstance(e, BlockRemoved)]
    assert all(len(e.block_hashes) == 1 and e.group_idx == 0 for e in gone)
    assert cache_view(sub.events()) == engine_view(engine)


def test_a_reset_that_leaves_nothing_cached_is_all_blocks_cleared(events):
    engine, sub = events()
    run(engine, "a", list(range(1, 50)))
    sub.wait(lambda evs: stored(evs))
    assert engine.reset_prefix_cache() == 3
    (batch,) = [b for _, b in sub.wait(lambda evs: isinstance(evs[-1], AllBlocksCleared))]
    assert batch.events == [AllBlocksCleared()]                # not the three removals it replaces
    assert cache_view(sub.events()) == engine_view(engine) == {"GPU": set(), "CPU": set()}


def test_a_reset_under_a_running_sequence_removes_block_by_block(events):
    engine, sub = events()
    run(engine, "a", list(range(1, 50)))                       # 3 cached blocks, free
    held = list(range(150, 190))                               # 2 full blocks, held by a running sequence
    submit(engine, GenerateRequest("b", held, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)))
    engine.step()
    sub.wait(lambda evs: len(stored(evs)) == 2)
    engine.reset_prefix_cache()
    batch = sub.wait(lambda evs: removed(evs))[-1][1]
    assert sorted(removed(batch.events)) == sorted(hash_chain(list(range(1, 50)), BLOCK_SIZE))
    assert not any(isinstance(e, AllBlocksCleared) for e in sub.events())
    assert cache_view(sub.events()) == engine_view(engine) and engine_view(engine)["GPU"]
    run_until_idle(engine)


def cache_view(evs) -> dict[str, set[int]]:
    """What a router following the events holds: medium -> hashes."""
    view: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for e in evs:
        if isinstance(e, BlockStored):
            view[e.medium] |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= view[e.medium], f"{e} removes what was never stored"
            view[e.medium] -= set(e.block_hashes)
        else:
            view["GPU"].clear()
    return view


def engine_view(engine) -> dict[str, set[int]]:
    tier = engine.scheduler.host_tier
    return {"GPU": set(engine.block_manager.cached), "CPU": set(tier.slots.slot_of) if tier else set()}


@pytest.mark.parametrize("write_through", [False, True])
def test_host_tier_moves_carry_medium_cpu(events, write_through):
    """Offloaded as the device evicts a block, or (asynchronous copies) written through as it is cached: each
    hash the host tier takes is a BlockStored of medium "CPU" with the block's parent and tokens, each it drops a
    BlockRemoved; the stream's view of both media is the engine's."""
    from test_host_tier_async import AsyncCopies
    kind = AsyncCopies if write_through else FakeExecutor
    engine, sub = events(kind(num_kv_blocks=10, host_kv_blocks=4), host_kv_blocks=4)
    first = list(range(1, 66))
    prompts = [first] + [[100 + i] + list(range(150, 214)) for i in range(5)]
    for i, prompt in enumerate(prompts):
        run(engine, f"p{i}", prompt)
    tier, cached = engine.scheduler.host_tier.slots, engine.block_manager.cached
    lost = [p for p in prompts if hash_chain(p, BLOCK_SIZE)[0] in set(tier.slot_of) - set(cached)]
    assert lost or write_through                               # (written through: the host has the newest)
    for prompt in lost[:1]:
        run(engine, "again", prompt)                           # its prefix back from the host tier
        assert tier.restored_blocks > 0
    sub.wait(lambda evs: cache_view(evs) == engine_view(engine))
    evs = sub.events()
    on_device = {}                                            # hash -> (parent, tokens) of its device store
    for e in stored(evs):
        for i, h in enumerate(e.block_hashes):
            on_device[h] = (e.block_hashes[i - 1] if i else e.parent_block_hash, e.token_ids[16 * i:16 * (i + 1)])
    host = stored(evs, "CPU")
    assert len(host) > 4 and removed(evs, "CPU")               # more than the tier holds went through it
    for e in host:
        (h,) = e.block_hashes
        assert (e.parent_block_hash, e.token_ids, e.block_size) == (*on_device[h], 16)
        if not write_through:                                  # offloaded as the device evicted it
            assert any(isinstance(r, BlockRemoved) and r.block_hashes == [h] for r in evs[:evs.index(e)])
    assert set(hash_chain(first, BLOCK_SIZE)) <= {e.block_hashes[0] for e in host}


def test_missed_batches_come_back_from_the_replay_socket(events):
    engine, sub = events()
    for i in range(4):
        run(engine, f"r{i}", [i] + list(range(1, 40)))
    sub.wait(lambda evs: len(stored(evs)) >= 4)
    last = sub.received[-1][0]
    assert sub.replay(0) == [(seq, sub.payloads[seq]) for seq in range(last + 1)]
    assert [seq for seq, _ in sub.replay(2)] == list(range(2, last + 1))
    assert sub.replay(last + 1) == []
    dealer = sub.ctx.socket(__import__("zmq").DEALER)            # a malformed request is dropped, the socket lives
    dealer.connect(f"tcp://127.0.0.1:{sub.replay_port}")
    dealer.send_multipart([b"", b"xy", b"z"])
    dealer.close(linger=0)
    assert [seq for seq, _ in sub.replay(last)] == [last]


def test_a_host_endpoint_is_connected_to_and_ranks_offset_it():
    """vLLM's rules: a wildcard (or ipc / inproc) endpoint is bound, a host one connected to (here a proxy's
    XSUB binds it and subscribes to everything); data-parallel rank r publishes on the tcp port + r, or the
    address + "_dp<r>"."""
    import zmq
    from engine.kv_event_publisher import offset_endpoint_port
    ctx = zmq.Context()
    sub = ctx.socket(zmq.XSUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    engine = make_engine(kv_events_config=KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"))
    try:
        time.sleep(0.3)
        sub.send(b"\x01")                                      # subscribe to every topic
        time.sleep(0.3)
        run(engine, "a", list(range(1, 40)))
        assert sub.poll(10_000) and len(sub.recv_multipart()) == 3
    finally:
        engine.kv_events.close(0.0)
        sub.close(linger=0)
        ctx.term()
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"


@pytest.mark.parametrize("text, message", [
    ("{enable", "not JSON"),
    ("[true]", "a JSON object is needed"),
    ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:5557"}', "unknown field(s) endpiont"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', 'publisher must be "zmq" or "null"'),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint must be a ZMQ address"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "replay_endpoint must differ"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"enable_kv_cache_events": true, "hwm": -1}', "hwm must be an integer >= 0"),
])
def test_a_malformed_flag_is_refused_at_start(text, message, capsys):
    from server.cli import build_parser
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--kv-events-config", text])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_flag_that_cannot_work_is_refused_at_start(monkeypatch):
    from engine.config import EngineConfig
    from server.cli import build_parser, engine_config
    config = build_parser().parse_args(["serve", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert engine_config(config).kv_events_config.endpoint == "tcp://*:5557"
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(enable_prefix_caching=False, kv_events_config=KVEventsConfig(True)).validate()
    port = free_port()
    engine = make_engine(kv_events_config=KVEventsConfig(True, endpoint=f"tcp://*:{port}"))
    with pytest.raises(ValueError, match=f"endpoint 'tcp://\\*:{port}'"):         # taken by the engine above
        make_engine(kv_events_config=KVEventsConfig(True, endpoint=f"tcp://*:{port}"))
    engine.kv_events.close(0.0)
    monkeypatch.setitem(sys.modules, "zmq", None)             # pyzmq not installed: the extra is named
    with pytest.raises(argparse.ArgumentTypeError, match=r"pip install 'openinfer\[kv-events\]'"):
        from server.cli import kv_events_config
        kv_events_config('{"enable_kv_cache_events": true}')
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled is False   # off: nothing needed
