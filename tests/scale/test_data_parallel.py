"""Data parallelism's parts without engines: which replica a request goes to (least loaded, prefix affinity,
vLLM's load score), where replicas run (one GPU each, one GPU shared with 1/N of the memory each — checked
against the arena's own budget formula —, the CPU, refusals), their KV event endpoints, their stats added up
and /metrics per engine."""
from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.kv_events import KVEventsConfig
from engine.process_dispatch import AFFINITY_ABS, Dispatcher, PrefixLRU, load_score, prompt_chain
from engine.process_placement import check_event_endpoints, place_replicas, visible_gpus
from engine.process_replicas import summed_stats
from engine.stats import EngineStats
from memory import device_arena
from memory.kv_pool import BLOCK_SIZE
from memory.prefix_hash import hash_chain
from server.metrics import ServerMetrics

SYSTEM = list(range(1000, 1000 + 4 * BLOCK_SIZE))           # a system prompt every conversation shares


def conversation(tag: int, turns: int) -> list[int]:
    """The shared system prompt, then `turns` blocks of this conversation's own history."""
    return SYSTEM + [tag * 100 + t % 50 for t in range(turns * BLOCK_SIZE)]


# -- dispatch ---------------------------------------------------------------------------------------------
def test_the_least_loaded_replica_serves_and_equal_loads_take_turns():
    d = Dispatcher([64, 64, 64])
    assert d.choose([], [3, 1, 2]) == 1
    assert [d.choose([], [0, 0, 0]) for _ in range(6)] == [2, 0, 1, 2, 0, 1]    # after 1: from 2 on
    assert d.choose([], [None, 5, None]) == 1                                    # the others are not serving
    with pytest.raises(RuntimeError, match="no engine process"):
        d.choose([], [None, None, None])


def test_vllms_load_score_weighs_waiting_four_times_running():
    """vLLM's DPLBAsyncMPClient: score = 4 · waiting + running; here in flight = running + waiting."""
    for running, waiting in [(0, 0), (3, 0), (0, 3), (5, 2)]:
        assert load_score(running + waiting, waiting) == 4 * waiting + running
    assert load_score(2, 7) == 2 + 3 * 2          # stats older than the requests sent since: capped by in flight


def test_a_conversation_returns_to_the_replica_holding_its_history():
    d = Dispatcher([1024, 1024])
    a, b = conversation(1, 2), conversation(2, 2)
    assert d.choose(prompt_chain(a), [0, 0]) == 0
    assert d.choose(prompt_chain(b), [AFFINITY_ABS + 1, 0]) == 1   # 0 holds the system prompt but is too busy
    # the next turns (longer histories) under loads that alone would send each to the other replica
    assert d.choose(prompt_chain(conversation(1, 4)), [1, 0]) == 0
    assert d.choose(prompt_chain(conversation(2, 4)), [0, 1]) == 1
    # a new conversation matches both replicas on the system prompt only: the least loaded one
    assert d.choose(prompt_chain(conversation(3, 2)), [1, 0]) == 1
    fresh = Dispatcher([1024, 1024])
    fresh.choose(prompt_chain(a), [0, 0])
    assert fresh.choose(prompt_chain(b), [1, 0]) == 0      # only 0 holds the system prompt, and is nearly as idle


def test_affinity_gives_way_once_its_replica_is_too_busy():
    def next_turn(loads: list[int]) -> int:
        d = Dispatcher([1024, 1024])
        assert d.choose(prompt_chain(conversation(1, 2)), [0, 0]) == 0
        return d.choose(prompt_chain(conversation(1, 3)), loads)
    assert next_turn([AFFINITY_ABS, 0]) == 0             # within max(2, 25 %) of the least loaded
    assert next_turn([AFFINITY_ABS + 1, 0]) == 1         # past it: the least loaded
    assert next_turn([10, 8]) == 0                       # 10 <= 8 + 25 % of 8
    assert next_turn([11, 8]) == 1


def test_a_named_replica_is_used_and_remembered_and_a_reset_forgets():
    d = Dispatcher([1024, 1024])
    chain = prompt_chain(conversation(1, 2))
    assert d.pinned(1, chain) == 1
    assert d.choose(prompt_chain(conversation(1, 3)), [0, 1]) == 1
    d.forget()
    assert d.choose(prompt_chain(conversation(1, 3)), [0, 1]) == 0


def test_chains_are_the_engines_block_hashes_and_adapters_do_not_share_them():
    prompt = conversation(1, 2)
    assert prompt_chain(prompt) == hash_chain(prompt, BLOCK_SIZE)
    assert len(prompt_chain(prompt + [1] * (BLOCK_SIZE - 1))) == len(prompt) // BLOCK_SIZE
    assert not set(prompt_chain(prompt, "adapter-a")) & set(prompt_chain(prompt))
    assert prompt_chain(prompt, "adapter-a") != prompt_chain(prompt, "adapter-b")


def test_the_prefix_lru_evicts_the_deepest_blocks_of_the_oldest_chain_first():
    lru = PrefixLRU(capacity=5)
    whole = prompt_chain(conversation(2, 2))         # the system prompt's 4 blocks, then 2 of its own
    lru.add(whole[:4])
    lru.add(whole[4:])                               # 6 > 5: the older chain's last block goes, its root stays
    assert lru.match(whole[:4]) == 3 and lru.match(whole) == 3
    lru.add(whole)                                   # all 6 again: the deepest is the oldest now
    assert len(lru.blocks) == 5 and lru.match(whole) == 5


# -- placement ------------------------------------------------------------------------------------------
def config(**kw) -> EngineConfig:
    return EngineConfig(**{"device": "auto", "data_parallel_size": 2, **kw})


def test_one_gpu_each_where_there_are_enough_and_tensor_parallel_ranks_side_by_side():
    p = place_replicas(config(), ["0", "1", "2"])
    assert [r.env for r in p.replicas] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    assert not p.one_by_one and all(r.gpu_memory_utilization == 0.9 for r in p.replicas)
    p = place_replicas(config(tensor_parallel_size=2), ["GPU-a", "GPU-b", "GPU-c", "GPU-d"])
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in p.replicas] == ["GPU-a,GPU-b", "GPU-c,GPU-d"]


def test_the_cpu_runs_one_numpy_engine_per_replica():
    for device, gpus in (("cpu", ["0", "1"]), ("auto", [])):
        p = place_replicas(config(device=device, data_parallel_size=3), gpus)
        assert [(r.rank, r.env) for r in p.replicas] == [(0, {}), (1, {}), (2, {})] and not p.one_by_one
    assert visible_gpus("cpu") == []


def test_replicas_sharing_one_gpu_each_get_about_a_nth_of_the_memory_fraction(monkeypatch):
    """Replica i starts once i-1 is up and is given (i+1)/N of the fraction; the arena's budget, utilization ·
    total − memory in use (memory/device_arena.py), then leaves each about utilization / N of the GPU."""
    n, util, total, context = 3, 0.9, 80 << 30, 500 << 20
    p = place_replicas(config(data_parallel_size=n, gpu_memory_utilization=util), ["0"])
    assert p.one_by_one and all(r.env == {"CUDA_VISIBLE_DEVICES": "0"} for r in p.replicas)
    in_use, held = 1 << 30, []                           # another process's 1 GiB before the replicas start
    for place in p.replicas:
        in_use += context                                # the replica's CUDA context, before its arena
        monkeypatch.setattr(device_arena, "device_memory_info", lambda: (total - in_use, total))
        arena = device_arena.arena_budget(place.gpu_memory_utilization)
        held.append(arena + context)
        in_use += arena
    assert in_use <= util * total
    assert all(abs(h - util * total / n) <= (1 << 30) for h in held), [h / 2**30 for h in held]


@pytest.mark.parametrize("kw, gpus, needle", [
    (dict(data_parallel_size=3), ["0", "1"], "needs 3 GPUs and 2 are visible"),
    (dict(tensor_parallel_size=2), ["0", "1"], "needs 4 GPUs and 2 are visible"),
    (dict(tensor_parallel_size=2), ["0"], "needs 4 GPUs and 1 are visible"),
    (dict(device="cuda"), [], "no GPU is visible"),
])
def test_combinations_that_cannot_run_are_refused(kw, gpus, needle):
    with pytest.raises(ValueError, match=needle):
        place_replicas(config(**kw), gpus)


def test_replicas_kv_event_endpoints_must_not_collide():
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")

    def events(**kw) -> KVEventsConfig:
        return KVEventsConfig(enable_kv_cache_events=True, **kw)
    with pytest.raises(ValueError, match="replica 1's endpoint tcp://\\*:5558 is also replica 0's replay_endpoint"):
        check_event_endpoints(config(kv_events_config=events(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")))
    check_event_endpoints(config(kv_events_config=events(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5567")))
    check_event_endpoints(config(data_parallel_size=4, kv_events_config=events(endpoint="ipc:///tmp/ev",
                                                                               replay_endpoint="ipc:///tmp/replay")))


def test_config_checks_the_rank():
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineConfig(data_parallel_size=0).validate()
    with pytest.raises(ValueError, match=r"data_parallel_rank must be in \[0, data_parallel_size\) = \[0, 2\)"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2).validate()


# -- stats and metrics ----------------------------------------------------------------------------------
def replica_stats() -> list[EngineStats]:
    return [EngineStats(num_running=2, num_waiting=1, kv_blocks_used=10, kv_blocks_total=100, prefix_cache_queries=40,
                        prefix_cache_hits=30, warming_up=0, lora_max_adapters=2, lora_adapters_loaded=3,
                        lora_running_adapters="a,b"),
            EngineStats(num_running=1, num_waiting=0, kv_blocks_used=30, kv_blocks_total=100, prefix_cache_queries=60,
                        prefix_cache_hits=10, warming_up=1, lora_max_adapters=2, lora_adapters_loaded=3,
                        lora_running_adapters="b,c")]


def test_stats_of_several_engines_add_up():
    total = summed_stats(replica_stats())
    assert (total.num_running, total.num_waiting, total.kv_blocks_used, total.kv_blocks_total) == (3, 1, 40, 200)
    assert total.kv_usage == 0.2 and total.prefix_cache_hit_rate == 0.4
    assert (total.warming_up, total.lora_max_adapters, total.lora_adapters_loaded) == (1, 2, 3)
    assert total.lora_running_adapters == "a,b,c"
    one = replica_stats()[0]
    assert summed_stats([one]) == one                  # one engine: its own stats
    spec = [dataclasses.replace(s, spec_decode_num_drafts=d, spec_decode_accepted_per_pos=pos)
            for s, d, pos in zip(replica_stats(), (4, 2), ((3, 1), (2,)))]
    total = summed_stats(spec)      # speculative decoding's counters: per position, position by position
    assert (total.spec_decode_num_drafts, total.spec_decode_accepted_per_pos) == (6, (5, 1))


def test_metrics_report_each_engine_under_its_label_and_the_total_unlabelled():
    replicas = replica_stats()
    text = ServerMetrics().render(summed_stats(replicas), replicas, dispatched=[7, 5])
    lines = text.splitlines()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}
    assert samples["openinfer_num_requests_running"] == 3.0
    assert samples['openinfer_num_requests_running{engine="0"}'] == 2.0
    assert samples['openinfer_num_requests_running{engine="1"}'] == 1.0
    assert samples['openinfer_kv_cache_usage_perc{engine="1"}'] == 0.3
    assert samples['openinfer_data_parallel_requests_total{engine="0"}'] == 7.0
    families = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(families) == len(set(families))                     # one HELP / TYPE per family ...
    for i, line in enumerate(lines):                               # ... its samples right after it
        if line.startswith("# TYPE"):
            name = line.split()[2]
            following = [x for x in lines[i + 1:i + 4] if not x.startswith("#")]
            assert all(x.startswith(name) for x in following), (name, following)
    assert "engine=" not in ServerMetrics().render(replicas[0])    # one engine: as before
