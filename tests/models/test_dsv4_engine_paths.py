"""DeepSeek-V4 (a line with per-sequence compressor rings) through the engine's other request paths on the numpy
executor: n = 2 seeded samples (forked before the prefill, each into its own ring), prompt logprobs (scored without
re-feeding a chunk's last token), a second wave of the same prompts hitting the prefix cache (replayed rings), and
the host KV tier under a device pool small enough to preempt. Each request must give exactly the tokens, and
prompt logprobs within 1e-4, of the same request alone on a fresh engine in one step."""
from __future__ import annotations

import os
import random

import numpy as np
from test_free_running_dsv4 import ISSUE, prompts_of

from engine.events import Finished, PromptLogprobs, Token
from engine.request import GenerateRequest, SamplingParams
from harness.free_running_oracle import new_engine
from harness.models import _tmp_root, build_tiny_model


def run(engine, requests: list[GenerateRequest]) -> dict:
    """request id (less its one-letter wave tag) -> (tokens by sample, prompt logprobs, cached tokens)."""
    events = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r, events[r.request_id].append)
    engine.drain_inbox()
    while engine.has_work():
        engine.step()
        engine.drain_inbox()
    out = {}
    for rid, evs in events.items():
        tokens = sorted((e.index, e.token_id) for e in evs if isinstance(e, Token))
        plps = [np.array([np.nan if v is None else v for v in e.logprobs]) for e in evs if isinstance(e, PromptLogprobs)]
        cached = max((e.usage.cached_tokens for e in evs if isinstance(e, Finished)), default=0)
        assert any(isinstance(e, Finished) for e in evs), f"{rid}: {evs[-1:]}"
        out[rid[1:]] = (tokens, plps, cached)
    return out


def requests(wave: str, prompts: list[list[int]]) -> list[GenerateRequest]:
    out = []
    for i, p in enumerate(prompts):
        out += [GenerateRequest(f"{wave}a{i}", p, SamplingParams(temperature=0.9, seed=i, max_tokens=10, n=2,
                                                                 ignore_eos=True)),
                GenerateRequest(f"{wave}b{i}", p + [11, 12], SamplingParams(temperature=0.0, max_tokens=4,
                                                                            prompt_logprobs=1, ignore_eos=True)),
                GenerateRequest(f"{wave}c{i}", p + [13, 14, 15], SamplingParams(temperature=0.0, max_tokens=10,
                                                                                ignore_eos=True))]
    return out


def assert_same(want: dict, got: dict, what: str) -> None:
    for rid, (tokens, plps, _) in want.items():
        assert got[rid][0] == tokens, f"{what} {rid}: tokens differ"
        assert len(got[rid][1]) == len(plps), f"{what} {rid}: prompt logprobs"
        for a, b in zip(plps, got[rid][1]):
            assert a.shape == b.shape and np.nanmax(np.abs(a - b)) <= 1e-4, f"{what} {rid}: prompt logprobs differ"


def test_samples_prompt_logprobs_prefix_hits_and_host_tier_match_each_request_alone():
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model

    model = load_model(build_tiny_model("deepseek_v4", os.path.join(_tmp_root(), "dsv4_paths"), seed=3, **ISSUE))

    def engine(host_kv_blocks: int = 0, **kw):
        ex = CpuExecutor(model, options_of(num_kv_blocks=64, max_model_len=256, host_kv_blocks=host_kv_blocks))
        return new_engine(ex, model.tokenizer, host_kv_blocks=host_kv_blocks, **kw)

    prompts = prompts_of(random.Random(5), [40, 23, 57])
    alone = {}
    for r in requests("x", prompts):
        alone.update(run(engine(budget=256), [r]))
    cached = engine(budget=16)
    assert_same(alone, run(cached, requests("y", prompts)), "chunked, together")
    second = run(cached, requests("z", prompts))
    assert_same(alone, second, "prefix hits")
    assert all(second[f"c{i}"][2] > 0 for i in range(len(prompts))), "the second wave hit the prefix cache"
    host = engine(budget=16, kv_blocks=10, host_kv_blocks=48)
    for wave in "hi":
        assert_same(alone, run(host, requests(wave, prompts)), "host tier, preempting")
    assert host.scheduler.num_preemptions > 0 and host.scheduler.host_tier.slots.restored_blocks > 0
