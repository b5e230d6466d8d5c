"""The real engine (CPU executor, tiny random-weight Qwen3 with the real Qwen tokenizer) behind a live
server on 127.0.0.1, driven by the official `openai` client.

Oracles: the transformers float32 model on the same weights (greedy picks and their logprobs), the
tokenizer (usage counts), and the engine's own single-request output (stop, concurrency).
"""
from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest

from engine.config import EngineConfig
from engine.handle import EngineHandle
from engine.request import SamplingParams
from server.app import create_app
from server.background import BackgroundServer
from harness.models import F32_LOGPROB_TOL, hf_logits, log_softmax, tiny_model_path

MODEL = "qwen3_tied"
MAX_MODEL_LEN = 512
LOGPROB_TOL = F32_LOGPROB_TOL


@pytest.fixture(scope="module")
def path():
    return tiny_model_path(MODEL)


@pytest.fixture(scope="module")
def handle(path):
    h = EngineHandle(EngineConfig(model=path, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=512,
                                  max_num_seqs=64))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def server(handle):
    with BackgroundServer(create_app(handle)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(handle, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = handle.stats()
        if s.num_requests == 0 and s.kv_blocks_used == 0:
            return s
        time.sleep(0.02)
    return handle.stats()


def test_greedy_completion_matches_the_transformers_oracle(client, handle, path):
    prompt = handle.tokenizer.encode("The quick brown fox jumps over")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = out.choices[0]
    ids = [int(t.split(":")[1]) for t in choice.logprobs.tokens]
    assert len(ids) == 12 and out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(prompt)
    assert choice.finish_reason == "length"
    oracle = log_softmax(hf_logits(path, prompt + ids))[len(prompt) - 1:-1]
    for pos, (tok, lp, top) in enumerate(zip(ids, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)):
        assert oracle[pos][tok] >= oracle[pos].max() - LOGPROB_TOL, f"greedy pick at {pos} is not the oracle's argmax"
        assert abs(lp - oracle[pos][tok]) < LOGPROB_TOL
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-6)
    assert choice.text == handle.tokenizer.decode(ids, skip_special_tokens=True)


def test_stream_and_non_stream_completions_agree(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_stream_and_non_stream_with_real_usage(client, handle):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    prompt_ids = handle.tokenizer.encode(handle.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_usage_counts_are_the_real_token_counts(client, handle):
    prompts = ["Hello world", "A longer prompt that spans more than one sixteen-token KV block, surely enough."]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, logprobs=0, temperature=0)
    assert out.usage.prompt_tokens == sum(len(handle.tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_echo_with_logprobs_scores_the_prompt(client, handle, path):
    prompt = "Paris is the capital of"
    ids = handle.tokenizer.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    oracle = log_softmax(hf_logits(path, ids))
    expected = [oracle[i - 1][ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], expected, atol=LOGPROB_TOL)


def test_n2_seed_reproducibility_and_stop(client, handle):
    kwargs = dict(model=MODEL, prompt="Roses are red,", max_tokens=12, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(n=2, **kwargs)
    b = client.completions.create(n=2, **kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 24
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert other.choices[0].text != a.choices[0].text
    reference = client.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = reference[len(reference) // 2:len(reference) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == reference[:reference.index(stop)]
    streamed = list(client.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=12, temperature=0,
                                              stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_streamed_logprobs_cover_every_token(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)
               for e in entries)


def test_over_long_request_is_a_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi " * 300, max_tokens=400)
    assert err.value.body["param"] == "max_tokens" and str(MAX_MODEL_LEN) in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)


def test_disconnect_after_three_chunks_frees_every_kv_block(server, handle):
    assert wait_idle(handle).kv_blocks_used == 0
    body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                assert handle.stats().kv_blocks_used > 0
                break
    stats = wait_idle(handle)
    assert stats.num_requests == 0 and stats.num_running == 0 and stats.kv_blocks_used == 0


def test_64_concurrent_streams_all_complete_with_the_right_output(server, handle):
    prompts = [f"Request number {i} says" for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = {p: handle.generate([p], params)[0].outputs[0].text for p in prompts[:8]}
    expected.update({p: handle.generate([p], params)[0].outputs[0].text for p in prompts[8:]})

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text, reasons = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        return text, reasons[-1]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120, http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=64))) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == [expected[p] for p in prompts]
    assert all(reason == "length" for _, reason in results)
    assert wait_idle(handle).kv_blocks_used == 0


def test_repeated_prompt_reports_cached_tokens_and_metrics(client, server, handle):
    prompt = "A shared system preamble that is long enough to fill two whole sixteen-token KV blocks, " * 2
    n_prompt = len(handle.tokenizer.encode(prompt))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n_prompt
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (n_prompt - 1) // 16 * 16 > 0     # whole 16-token blocks; the last token is recomputed
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    stats = handle.stats()
    assert stats.prefix_cache_hit_rate > 0
    assert values["openinfer_prefix_cache_hit_rate"] == pytest.approx(stats.prefix_cache_hit_rate)
    assert values["openinfer_prompt_tokens_cached_total"] >= cached
    assert values["openinfer_engine_kv_blocks_total"] == stats.kv_blocks_total


def test_reset_prefix_cache_route_evicts_the_cached_prefix(client, server, handle):
    """vLLM's POST /reset_prefix_cache: the repeat after it finds nothing cached, the one after that hits."""
    prompt = "Another preamble, long enough for two whole sixteen-token KV blocks of cached prefix. " * 2
    ask = lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)  # noqa: E731
    first, second = ask(), ask()
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    r = httpx.post(server.url + "/reset_prefix_cache", timeout=10)
    assert r.status_code == 200
    third, fourth = ask(), ask()
    assert not third.usage.prompt_tokens_details or not third.usage.prompt_tokens_details.cached_tokens
    assert fourth.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens
    assert first.choices[0].text == third.choices[0].text == fourth.choices[0].text


def test_non_streaming_client_that_times_out_frees_its_request(server, handle):
    body = {"model": MODEL, "prompt": "Go on and on", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    stats = wait_idle(handle)
    assert stats.num_requests == 0 and stats.kv_blocks_used == 0
