"""Tensor parallelism through the engine: `EngineConfig(tensor_parallel_size=2)` on the CPU (two numpy
ranks on threads) decodes the same greedy tokens as one executor, in the engine's own thread and in the
engine process, with chunked prefill, prefix-cache hits and the host KV tier; combinations that cannot
work are refused at start."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.handle import EngineHandle
from engine.request import SamplingParams
from harness.models import test_prompts, tiny_model_path
from server.startup import describe_executor

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)


def config(tp: int, **kw) -> EngineConfig:
    base = dict(model=tiny_model_path("qwen3_tied"), device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=256, progress=False, tensor_parallel_size=tp)
    return EngineConfig(**{**base, **kw})


def generate(handle_cls, cfg: EngineConfig, rounds: int = 1):
    with handle_cls(cfg) as h:
        prompts = test_prompts(h.tokenizer, 5)
        outs = []
        for _ in range(rounds):            # later rounds hit the prefix cache (and the host tier)
            outs += [r.outputs[0] for r in h.generate(prompts, GREEDY)]
        return h, outs


def same_outputs(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert np.allclose([o.logprobs for o in a], [o.logprobs for o in b], atol=1e-4)


def test_two_ranks_decode_as_one_executor():
    h1, one = generate(EngineHandle, config(1), rounds=2)
    h2, two = generate(EngineHandle, config(2), rounds=2)
    assert type(h2.executor).__name__ == "TensorParallelExecutor" and h2.executor.world_size == 2
    line = describe_executor(h2, "cpu")                      # what `openinfer serve` logs at start
    assert line.startswith("executor: CpuRankExecutor (numpy) on the CPU (--device cpu); tensor parallel over 2")
    assert h2.engine.stats().prefix_cache_hits > 0
    same_outputs(one, two)


def test_two_ranks_in_the_engine_process():
    from engine.process import EngineClient

    _, one = generate(EngineHandle, config(1))
    _, two = generate(EngineClient, config(2))
    same_outputs(one, two)


def test_host_tier_copies_every_ranks_shard():
    """A pool of 12 blocks: a prompt, other long prompts that push its blocks out, the prompt again: its
    prefix comes back from the host tier (copy_blocks runs on each rank over its own KV heads)."""
    runs = {}
    for tp in (1, 2):
        with EngineHandle(config(tp, num_kv_blocks=12, host_kv_blocks=16, max_num_seqs=2)) as h:
            prompt = list(range(100, 150))
            outs = [h.generate([prompt], GREEDY)[0].outputs[0]]
            for i in range(4):
                h.generate([[300 + i] + list(range(1, 70))], GREEDY)
            outs.append(h.generate([prompt], GREEDY)[0].outputs[0])
            assert h.engine.stats().host_kv_restored_blocks >= 3
            runs[tp] = outs
    same_outputs(runs[1], runs[2])


@pytest.mark.parametrize("kw,error,words", [
    (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size 3: does not divide num_attention_heads"),
    (dict(model="deepseek_v2_lite"), ValueError, "the deepseek_v2 line has no tensor-parallel sharding"),
    (dict(model="deepseek_v3"), ValueError, "the deepseek_v3 line has no tensor-parallel sharding"),
    (dict(model="deepseek_v4"), ValueError, "the deepseek_v4 line has no tensor-parallel sharding"),
    (dict(enable_lora=True), ValueError, "enable_lora with tensor_parallel_size > 1"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be >= 1"),
])
def test_what_cannot_work_is_refused_at_start(kw, error, words):
    if kw.get("model"):
        kw["model"] = tiny_model_path(kw["model"])
    with pytest.raises(error, match=words):
        EngineHandle(config(2, **kw))


def test_more_ranks_than_gpus_is_refused_before_anything_starts(monkeypatch):
    from engine.executor.options import options_of
    from engine.loader import load_model
    from engine.parallel import worker
    from engine.parallel.launch import create_parallel_executor

    monkeypatch.setattr(worker, "gpu_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 is more than the 1 GPU"):
        model = load_model(tiny_model_path("qwen3_untied"))
        create_parallel_executor(model, options_of(tensor_parallel_size=2), "cuda")
