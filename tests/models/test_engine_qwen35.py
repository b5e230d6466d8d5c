"""The Qwen3.5 hybrid line through the real engine on the CPU (EngineHandle, device="cpu"): concurrent
requests with chunked prefill and preemption generate what the transformers float32 oracle picks
greedily, every state slot comes back (finish, abort, preemption), n > 1 samples fork before any
prefill, prefix caching is off for the line (a repeated prompt equals its first run), chunked prompt
logprobs are whole, and `openinfer serve --device cpu` serves it."""
from __future__ import annotations

import asyncio
import logging
import random
import subprocess

import numpy as np
import openai
import pytest

from engine.config import EngineConfig
from engine.events import Token
from engine.handle import EngineHandle
from engine.request import GenerateRequest, SamplingParams
from harness.hybrid_models import hybrid_hf_logits, hybrid_model_path
from harness.models import log_softmax

MODEL = "qwen3_5_text"
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return hybrid_model_path(MODEL)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(150000) for _ in range(n)] for n in (3, 17, 40, 61, 9)]


@pytest.fixture(scope="module")
def oracle(path, prompts):
    """The transformers float32 greedy continuation of each prompt (a full forward per token)."""
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(NEW):
            ids.append(int(np.argmax(hybrid_hf_logits(path, ids)[-1])))
        out.append(ids[len(p):])
    return out


def handle_for(path, **config) -> EngineHandle:
    return EngineHandle(EngineConfig(model=path, device="cpu", max_model_len=256, **config))


def slots_in_use(handle: EngineHandle) -> int:
    return handle._engine.scheduler.state_slots.num_used


def test_concurrent_chunked_requests_match_the_oracle(path, prompts, oracle):
    with handle_for(path, max_num_batched_tokens=32, max_num_seqs=4) as h:
        outs = h.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == oracle
        assert h.stats().num_steps > len(prompts) + NEW       # chunked prefill mixed with decodes
        assert slots_in_use(h) == 0


def test_preemption_recomputes_from_zero_state(path, prompts, oracle):
    """A KV pool too small for every sequence at once preempts; a preempted sequence gives its slot back
    and recomputes from zero state, so the outputs do not change."""
    with handle_for(path, num_kv_blocks=9, max_num_batched_tokens=64) as h:
        outs = h.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == oracle
        assert h.stats().num_preemptions > 0
        assert slots_in_use(h) == 0


def test_abort_frees_the_slot_and_spares_the_others(path, prompts, oracle):
    with handle_for(path, max_num_seqs=4) as h:
        seen, others = asyncio.run(_abort_run(h, prompts))
        assert 3 <= seen < 200
        assert others == [oracle[0], oracle[1]]
        assert _wait(lambda: slots_in_use(h) == 0)


async def _abort_run(h, prompts):
    long = h.submit(GenerateRequest("long", prompts[2], SamplingParams(temperature=0, max_tokens=200,
                                                                        ignore_eos=True)))
    others = [h.submit(GenerateRequest(f"r{i}", prompts[i], GREEDY)) for i in (0, 1)]

    async def tokens(stream, abort_after=None):
        got = []
        async for event in stream:
            if isinstance(event, Token):
                got.append(event.token_id)
                if len(got) == abort_after:
                    h.abort("long")
        return got

    results = await asyncio.gather(tokens(long, abort_after=3), *(tokens(s) for s in others))
    return len(results[0]), results[1:]


def _wait(cond, timeout: float = 10.0) -> bool:
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_n_samples_fork_before_prefill(path, prompts, oracle):
    with handle_for(path) as h:
        out = h.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, n=3))[0]
        assert [s.token_ids for s in out.outputs] == [oracle[1]] * 3
        assert slots_in_use(h) == 0


def test_prefix_caching_is_off_and_a_repeat_equals_the_first_run(path, prompts, oracle, caplog):
    with caplog.at_level(logging.INFO, logger="openinfer.engine"):
        h = handle_for(path, enable_prefix_caching=True)
    with h:
        assert "prefix caching off" in caplog.text
        assert not h._engine.block_manager.enable_prefix_caching
        first, again = (h.generate([prompts[3]], GREEDY)[0] for _ in range(2))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == oracle[3]
        assert again.cached_tokens == 0
    with pytest.raises(ValueError, match="host_kv_blocks"):
        handle_for(path, host_kv_blocks=4)


def test_chunked_prompt_logprobs_are_whole(path, prompts):
    p = prompts[3]
    with handle_for(path, max_num_batched_tokens=16, max_num_seqs=4) as h:
        out = h.generate([p], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    lps = out.prompt_logprobs.logprobs
    want = log_softmax(hybrid_hf_logits(path, p))[np.arange(len(p) - 1), p[1:]]
    assert lps[0] is None and None not in lps[1:]
    assert np.max(np.abs(np.array(lps[1:]) - want)) <= 1e-3


def test_openinfer_serve_on_the_cpu(path, prompts, oracle):
    from test_server_cli import OPENINFER, ROOT, free_port, interrupt, wait_healthy
    port = free_port()
    proc = subprocess.Popen(OPENINFER + ["serve", "--model", path, "--device", "cpu", "--port", str(port),
                                         "--served-model-name", "hybrid", "--max-model-len", "256"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="hybrid", prompt=prompts[2], max_tokens=NEW, temperature=0,
                                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                        logprobs=0)
        assert out.usage.completion_tokens == NEW
        assert [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens] == oracle[2]
    finally:
        interrupt(proc)
    assert proc.returncode == 0, proc.stderr.read()
