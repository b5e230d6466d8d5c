"""Host side of tensor parallelism (no GPU): the numpy group's collectives, the step the other ranks get
(follower_batch), the order the follower loop reads steps back in, the decode-graph choice rank 0 sends
(DecodeGraphs.mode, GpuRankExecutor.graph_key) and the arena bytes a GPU rank's ops add."""
from __future__ import annotations

import os
import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from bench.ab_switches import ABDecodeGraphs
from engine.parallel.comm import LocalGroup
from engine.parallel.executor import follower_batch
from engine.parallel.ranks import follower_loop
from engine.request import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def on_ranks(group: LocalGroup, fn) -> list:
    """fn(communicator) on one thread per rank; their results in rank order."""
    out = [None] * group.world_size
    threads = [threading.Thread(target=lambda c=c: out.__setitem__(c.rank, fn(c))) for c in group.communicators()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_collectives_give_every_rank_the_same_bits():
    group = LocalGroup(3, timeout=10)
    xs = [np.random.default_rng(r).standard_normal((4, 5)).astype(np.float32) for r in range(3)]
    sums = on_ranks(group, lambda c: c.all_reduce(xs[c.rank]))
    assert all(np.array_equal(s, (xs[0] + xs[1]) + xs[2]) for s in sums)
    gathered = on_ranks(group, lambda c: c.all_gather(xs[c.rank]))
    assert all(np.array_equal(g, np.stack(xs)) for g in gathered)
    assert all(np.array_equal(b, xs[2]) for b in on_ranks(group, lambda c: c.broadcast(xs[c.rank], root=2)))


def test_an_aborted_group_frees_waiting_ranks_and_resets():
    group = LocalGroup(2, timeout=10)
    comms = group.communicators()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(threading.BrokenBarrierError, comms[1].all_reduce,
                                                                    np.ones(2))))
    t.start()
    group.abort()
    t.join(10)
    assert errors and not t.is_alive()
    group.reset()
    assert all(np.array_equal(s, [2.0, 2.0]) for s in on_ranks(group, lambda c: c.all_reduce(np.ones(2))))


def seq(i: int, n: int = 1, **kw) -> SeqStep:
    return SeqStep(seq_id=i, token_ids=list(range(10, 10 + n)), start_pos=kw.pop("start_pos", 4), block_table=[i],
                   sample=kw.pop("sample", True), **kw)


def test_follower_steps_keep_what_decides_the_code_path():
    grammar = object()
    steps = [seq(0, params=SamplingParams(temperature=0.7, top_k=3, logprobs=2), grammar=grammar),
             seq(1, n=5, start_pos=0, sample=False, want_prompt_logprobs=True, prompt_len=9,
                 history=list(range(10, 19)), params=SamplingParams(prompt_logprobs=1)),
             seq(2, params=SamplingParams(repetition_penalty=1.3), history=[5] * 400)]
    batch = ModelBatch.build(steps)
    stub = follower_batch(batch)
    assert stub.input_ids is batch.input_ids and stub.block_tables is batch.block_tables
    for a, b in zip(batch.seqs, stub.seqs):
        assert (b.sample, b.want_prompt_logprobs, b.prompt_logprob_targets()) == \
            (a.sample, a.want_prompt_logprobs, a.prompt_logprob_targets())
        assert b.params.greedy and b.params.logprobs is None and b.grammar is None
    assert stub.seqs[1].prompt_logprob_targets() == [11, 12, 13, 14, 15]     # the next prompt token too
    assert stub.seqs[2].history == []                                        # no penalty history sent
    again = pickle.loads(pickle.dumps(stub))                                 # what goes to a GPU rank's process
    assert np.array_equal(again.slot_mapping, batch.slot_mapping) and again.seqs[1].prompt_logprob_targets() == \
        stub.seqs[1].prompt_logprob_targets()


class Recorder:
    """A rank executor that records the order of its calls and of its steps' result()."""

    def __init__(self):
        self.log = []

    def follow(self, batch, fed=False, key=None):
        self.log.append(f"follow {batch}")
        return SimpleNamespace(result=lambda: self.log.append(f"result {batch}"))

    def warm_up(self):
        self.log.append("warm_up")


def test_follower_reads_steps_back_in_rank_zeros_order():
    """A plain step is read back before the next one starts; a fed step is queued while the step before
    it is still out (async scheduling), which is read right after."""
    calls = [("follow", ("a", False, None)), ("follow", ("b", False, None)), ("follow", ("c", True, (1, False))),
             ("follow", ("d", True, (1, False))), ("warm_up", ()), ("close", ())]
    ex, replies = Recorder(), []
    follower_loop(ex, iter(calls).__next__, replies.append)
    assert ex.log == ["follow a", "result a", "follow b", "follow c", "result b", "follow d", "result c",
                      "result d", "warm_up"]
    assert replies == [None] * 5


def test_rank_zeros_graph_choice():
    """mode(): which graph a decode step replays; graph_key: what the other ranks are told (None: eager)."""
    from engine.parallel.gpu_ops import GpuRankExecutor

    graphs = ABDecodeGraphs(None, None, None, None, None, None, None, (1, 2, 4, 8))
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3)
    assert graphs.mode([seq(0, params=greedy)]) == "greedy"
    assert graphs.mode([seq(0, params=greedy), seq(1, params=sampled)]) == "sampling"
    assert graphs.mode([seq(0, params=greedy, grammar=object())]) == "masked"
    assert graphs.mode([seq(0, params=SamplingParams(logit_bias={3: 1.0}))]) == "eager"
    graphs.sample_in_graph = False
    assert graphs.mode([seq(0, params=sampled)]) == "eager"
    graphs.sample_in_graph = True
    key = lambda steps: GpuRankExecutor.graph_key(SimpleNamespace(graphs=graphs), ModelBatch.build(steps))  # noqa: E731
    assert key([seq(i, params=sampled) for i in range(3)]) == (4, True)
    assert key([seq(0, params=greedy)]) == (1, False)
    assert key([seq(0, n=3, params=greedy)]) is None                          # a prefill chunk: eager
    assert key([seq(i, params=greedy) for i in range(9)]) is None             # beyond the largest bucket


@pytest.mark.parametrize("model,extra", [("qwen3-8b", 1024 * 151936 * 4),
                                         ("qwen3-30b-a3b", 1024 * 151936 * 4 + 8192 * 8 * 4)])
def test_a_gpu_rank_takes_the_gathered_logits_and_expert_ids(model, extra):
    """Qwen3-8B / Qwen3-30B-A3B at TP=2 with vLLM's defaults: a rank's ops take the [1024, V] float32
    gather buffer (and the rank's view of 8192 x top-8 router ids) beyond one GPU's."""
    from engine.config import EngineConfig
    from engine.executor.gpu_arena_sizes import parts_nbytes
    from engine.executor.gpu_plan import DeviceInfo, gpu_plan
    from engine.executor.options import GpuTuning, resolved_options
    from engine.model_config import ModelConfig
    from engine.parallel.gpu_ops import RankGpuOps
    from engine.models.registry import build_model
    from engine.parallel.sharding import shard_config

    cfg = ModelConfig.from_file(os.path.join(ROOT, "bench", "configs", model, "config.json"))
    config = EngineConfig(gpu=GpuTuning(), tensor_parallel_size=2)
    options = resolved_options(config, "cuda", cfg.max_position_embeddings)[1]
    plan = gpu_plan(options, build_model(shard_config(cfg, 2)), DeviceInfo("H200", 132, 141 << 30, "90"))
    assert plan.kv.heads == cfg.num_key_value_heads // 2
    mine, one = parts_nbytes(plan, 128, True, RankGpuOps), parts_nbytes(plan, 128, True)
    assert extra <= mine["ops"] - one["ops"] <= extra + 1024


def test_nccl_library_binds_where_installed():
    """libnccl through ctypes (no GPU needed for these two calls): a version with bf16 all-reduces and a
    128-byte communicator id that survives the trip to the other ranks."""
    from engine.parallel.comm import NcclUniqueId, nccl_library, nccl_unique_id

    try:
        lib = nccl_library()
    except OSError:
        pytest.skip("libnccl is not installed (the nvidia-nccl wheel of the GPU image)")
    import ctypes

    version = ctypes.c_int()
    assert lib.ncclGetVersion(ctypes.byref(version)) == 0 and version.value >= 21000
    uid = nccl_unique_id()
    assert len(uid) == 128 and bytes(NcclUniqueId.from_buffer_copy(pickle.loads(pickle.dumps(uid)))) == uid
