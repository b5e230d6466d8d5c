"""The HTTP protocol layer against a scripted engine: request validation, response and chunk
schemas, SSE framing, auth, error bodies, disconnect -> abort, metrics text.

The fake engine (tests/fake_handle.py) is deterministic and defined from first principles (a byte
tokenizer and a 'model' that replays the prompt backwards), so every expected value below is computed.
"""
from __future__ import annotations

import json
import time

import httpx
import numpy as np
import openai
import pytest

from fake_handle import ByteTokenizer, FakeHandle, expected_text, fake_logprob
from server.app import create_app
from server.background import BackgroundServer

@pytest.fixture(scope="module")
def handle():
    return FakeHandle(token_delay=0.002)


@pytest.fixture(scope="module")
def server(handle):
    with BackgroundServer(create_app(handle, max_body_bytes=64 * 1024)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_completion_matches_the_engine_output_and_counts(client):
    out = client.completions.create(model="fake-model", prompt="hello", max_tokens=7)
    assert out.object == "text_completion" and out.model == "fake-model" and out.id.startswith("cmpl-")
    assert out.choices[0].text == expected_text("hello", 7)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 7, 12)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_forms_and_n_give_prompt_major_choice_indices(client, handle):
    out = client.completions.create(model="fake-model", prompt=["abc", "wxyz"], max_tokens=4, n=2)
    texts = {c.index: c.text for c in out.choices}
    assert texts == {0: expected_text("abc", 4, 0), 1: expected_text("abc", 4, 1),
                     2: expected_text("wxyz", 4, 0), 3: expected_text("wxyz", 4, 1)}
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 16
    ids = ByteTokenizer().encode("abc")
    for prompt in (ids, [ids]):
        same = client.completions.create(model="fake-model", prompt=prompt, max_tokens=4)
        assert same.choices[0].text == expected_text("abc", 4)
    assert isinstance(handle.submitted[-1].prompt_token_ids, np.ndarray)      # token ids travel as an int32 array
    assert handle.submitted[-1].prompt_token_ids.tolist() == ids


def test_streaming_completion_sse_framing_and_usage(server):
    body = {"prompt": "stream me", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected_text("stream me", 5)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_stream_and_non_stream_agree(client, handle):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=6)
    template = ByteTokenizer().apply_chat_template(messages)
    assert handle.submitted[-1].prompt_token_ids.tolist() == ByteTokenizer().encode(template)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text(template, 6)
    stream = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == len(template)


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_continuous_usage_stats_put_each_choices_running_usage_on_its_chunks(server):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far (its
    prompt's tokens, the tokens that choice streamed up to then); the last chunk is the whole usage."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    prompts = ["abc", "wxyz"]
    chunks = stream_chunks(server.url, "/v1/completions",
                           {"prompt": prompts, "max_tokens": 4, "n": 2, "stream_options": opts})
    streamed = dict.fromkeys(range(4), 0)
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        streamed[choice["index"]] += len(ByteTokenizer().encode(choice["text"]))
        prompt = len(prompts[choice["index"] // 2])
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": streamed[choice["index"]],
                                  "total_tokens": prompt + streamed[choice["index"]]}
    assert streamed == dict.fromkeys(range(4), 4)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    template = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    chat = stream_chunks(server.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream_options": opts})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[0]["usage"]["completion_tokens"] == 0 and chat[0]["usage"]["prompt_tokens"] == len(template)
    assert [c["usage"]["completion_tokens"] for c in chat[1:-1]] == [1, 2, 3, 3]   # the last: finish_reason
    plain = stream_chunks(server.url, "/v1/completions", {"prompt": "abc", "max_tokens": 2,
                                                          "stream_options": {"continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in plain)          # as vLLM: include_usage defaults to true here
    off = stream_chunks(server.url, "/v1/completions", {"prompt": "abc", "max_tokens": 2, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})
    assert all("usage" not in c for c in off)


def test_chat_text_parts_join_with_newlines_as_vllm_renders_them(client, handle):
    """vLLM hands a chat template a message of text parts as one string, the parts joined by newlines."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": parts}], max_tokens=1)
    template = ByteTokenizer().apply_chat_template([{"role": "user", "content": "Hello\nWorld"}])
    assert handle.submitted[-1].prompt_token_ids.tolist() == ByteTokenizer().encode(template)


def test_chat_default_max_tokens_fills_the_context(client, handle):
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], stream=False)
    req = handle.submitted[-1]
    assert req.params.max_tokens == FakeHandle.max_model_len - len(req.prompt_token_ids)


def test_logprobs_and_echo(client):
    out = client.completions.create(model="fake-model", prompt="abcd", max_tokens=3, logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text == "abcd" + expected_text("abcd", 3)
    lp = choice.logprobs
    assert lp.tokens == list("abcd") + list(expected_text("abcd", 3))
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == [fake_logprob(t) for t in ByteTokenizer().encode(choice.text)[1:]]
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == list(range(7))
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "q"}],
                                          max_tokens=2, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == fake_logprob(ByteTokenizer().encode(content[0].token)[0])


def test_sampling_fields_reach_the_engine(client, handle):
    client.completions.create(model="fake-model", prompt="hi", max_tokens=4, temperature=0.5, top_p=0.9,
                              seed=7, stop=["x", "yz"], presence_penalty=0.5, frequency_penalty=-0.5,
                              logit_bias={"5": -100}, user="u1",
                              extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2,
                                          "ignore_eos": True, "stop_token_ids": [3], "best_of": 1})
    p = handle.submitted[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 5, 0.1, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.stop == ["x", "yz"] and p.stop_token_ids == [3] and p.logit_bias == {5: -100.0}
    assert (p.min_tokens, p.ignore_eos, p.max_tokens) == (2, True, 4)
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "q"}],
                                   max_completion_tokens=9)
    assert handle.submitted[-1].params.max_tokens == 9


BAD_REQUESTS = [
    # (path, body, status, param)
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 256}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": "tail"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"7": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 422, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 422, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 422, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": False}, 422, "stream_options"),
    ("/v1/completions", {"prompt": {"text": "x"}}, 422, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 422, "prompt"),
    ("/v1/completions", [1, 2], 422, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 422, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": {"a": 1}}}]}, 422,
     "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": False,
                              "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/detokenize", {"tokens": [1, "a"]}, 422, "tokens"),
    ("/tokenize", {}, 422, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_their_4xx_and_an_error_body(server, handle, path, body, status, param):
    before = len(handle.submitted)
    r = httpx.post(server.url + path, json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert isinstance(err["message"], str) and err["message"]
    if param:
        assert param.split("[")[0] in err["message"]
    assert len(handle.submitted) == before       # refused before reaching the engine


@pytest.mark.parametrize("raw,status", [(b"{not json", 400), (b"", 400), (b"x" * 70_000, 413)])
def test_malformed_and_oversized_bodies(server, raw, status):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_oversized_headers_are_not_called_a_large_body(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10,
                   headers={"x-padding": "a" * 20_000})
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert "header" in message and "body" not in message


def test_unknown_route_and_method_are_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_models_health_version_tokenize(server):
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["max_model_len"] == FakeHandle.max_model_len
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "héllo"}, timeout=10).json()
    assert tok["tokens"] == ByteTokenizer().encode("héllo") and tok["count"] == 6
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
    assert back["prompt"] == "héllo"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert chat["tokens"] == ByteTokenizer().encode("<user>a\n<assistant>")


def test_metrics_count_tokens_and_export_engine_stats(server, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line and not line.startswith("#")}
    before = scrape()
    client.completions.create(model="fake-model", prompt="metric", max_tokens=5)
    after = scrape()
    assert after["openinfer_generation_tokens_total"] - before["openinfer_generation_tokens_total"] == 5
    assert after["openinfer_prompt_tokens_total"] - before["openinfer_prompt_tokens_total"] == 6
    assert after["openinfer_time_to_first_token_seconds_count"] == before["openinfer_time_to_first_token_seconds_count"] + 1
    assert after['openinfer_e2e_request_latency_seconds_bucket{le="+Inf"}'] >= 1
    assert after["openinfer_time_per_output_token_seconds_count"] >= 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_kv_blocks_used"):
        assert "openinfer_" + name in after


def test_lora_requests_info_escapes_adapter_names():
    """Prometheus label values escape backslashes, quotes and newlines; no line at all without LoRA."""
    from engine.stats import EngineStats
    from server.metrics import lora_info
    assert lora_info(EngineStats()) == []
    line = lora_info(EngineStats(lora_max_adapters=4, lora_running_adapters='a"b,c\\d', lora_waiting_adapters="e\nf"))[-1]
    assert line.startswith('openinfer_lora_requests_info{running_lora_adapters="a\\"b,c\\\\d",max_lora="4",'
                           'waiting_lora_adapters="e\\nf"} ')


def test_disconnect_mid_stream_aborts_the_engine_request():
    handle = FakeHandle(token_delay=0.05)
    with BackgroundServer(create_app(handle)) as srv:
        body = {"prompt": "long", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            got = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(line)
                if len(got) == 3:
                    break
        deadline = time.monotonic() + 10
        while handle.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert handle.active == set()
        assert len(handle.aborted) == 1 and handle.aborted[0].startswith("cmpl-")
        assert handle.stats().kv_blocks_used == 0


def test_health_is_503_when_the_engine_is_down():
    handle = FakeHandle()
    handle.is_healthy = lambda: False
    with BackgroundServer(create_app(handle)) as srv:
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_api_key_guards_v1_routes_only():
    with BackgroundServer(create_app(FakeHandle(), api_key="sekret")) as srv:
        r = httpx.get(srv.url + "/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="fake-model", prompt="a", max_tokens=1).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_engine_rejection_is_400_and_engine_error_is_500_or_an_sse_error():
    with BackgroundServer(create_app(FakeHandle(reject="needs more KV cache"))) as srv:
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "stream": stream}, timeout=10)
            assert r.status_code == 400 and "needs more KV cache" in r.json()["error"]["message"]
    with BackgroundServer(create_app(FakeHandle(fail="kernel fault"))) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}, timeout=10)
        assert r.status_code == 500 and "kernel fault" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "stream": True}, timeout=10)
        events = [e[6:] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]" and "kernel fault" in json.loads(events[-2])["error"]["message"]


def test_a_shut_down_engine_is_503():
    class ClosedHandle(FakeHandle):
        def submit(self, req):
            raise RuntimeError("engine is shut down")
    with BackgroundServer(create_app(ClosedHandle())) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}, timeout=10)
        assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    class StrictTokenizer(ByteTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            if messages[0]["role"] != "user":
                raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
            return super().apply_chat_template(messages, add_generation_prompt)
    handle = FakeHandle()
    handle.tokenizer = StrictTokenizer()
    with BackgroundServer(create_app(handle)) as srv:
        body = {"messages": [{"role": "assistant", "content": "x"}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "must alternate" in r.json()["error"]["message"]


FUZZ_VALUES = [None, True, False, -1, 0, 1, 2, 2.5, -0.5, 1e9, 1e300, "x", "", "\u00e9\U0001f680", [], [1], [0, 5],
               ["a"], ["a", ""], [[1, 2]], [[]], {}, {"a": 1}, {"7": 1}, {"include_usage": "yes"}]
FUZZ_FIELDS = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "top_k", "min_p", "n", "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "ignore_eos",
               "min_tokens", "user", "stream", "stream_options", "suffix", "best_of", "response_format",
               "tools", "skip_special_tokens", "add_generation_prompt", "return_tokens_as_token_ids"]


def test_fuzzed_bodies_never_get_a_500(server):
    """Random mixes of known fields and odd values: every answer is a 200 or a 4xx with an error body."""
    import random
    rng = random.Random(0)
    statuses = set()
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for i in range(300):
            body = {f: rng.choice(FUZZ_VALUES) for f in rng.sample(FUZZ_FIELDS, rng.randint(1, 6))}
            if rng.random() < 0.7:
                body.setdefault("prompt", "ok")
                body.setdefault("messages", [{"role": "user", "content": "ok"}])
            path = "/v1/completions" if i % 2 else "/v1/chat/completions"
            r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            statuses.add(r.status_code)
            assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (body, r.text)
    assert 200 in statuses and {400, 422} <= statuses
