"""Bad input, as an attacker sends it, to the real server (CPU engine, tiny model, the real Qwen
tokenizer, an API key): every case is a 4xx with an OpenAI error body naming the field — never a 500,
never an accepted request that should have been refused — and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest

from server.app import create_app
from server.background import BackgroundServer
from server.limits import ServerLimits
from tests.tiny_engine import tiny_handle

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServerLimits()
MAX_MODEL_LEN = 256


def deep(levels: int, key: str = "prompt") -> bytes:
    """A small body whose `key` nests `levels` lists deep."""
    return ('{"%s": ' % key + "[" * levels + "]" * levels + "}").encode()


def raw(text: str) -> bytes:
    return text.encode()


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (case, method, path, body bytes, headers (AUTH when None), status, error param)
CASES = [
    ("json 1000 deep: completions", "POST", CMPL, deep(1000), None, 400, "prompt"),
    ("json 1000 deep: chat", "POST", CHAT, deep(1000, "messages"), None, 400, "messages"),
    ("json 1000 deep: tokenize", "POST", "/tokenize", deep(1000), None, 400, "prompt"),
    ("json 100 deep (parses)", "POST", CMPL, deep(100), None, 400, "prompt"),
    ("json 1000 deep after other fields", "POST", CMPL,
     raw('{"model": "m", "max_tokens": 2, "stop": ' + "[" * 1000 + "]" * 1000 + "}"), None, 400, "stop"),
    ("lone surrogate: prompt", "POST", CMPL, raw('{"prompt": "\\ud800abc", "max_tokens": 2}'), None, 400,
     "prompt"),
    ("lone surrogate: prompt list", "POST", CMPL, raw('{"prompt": ["ok", "\\udfffx"], "max_tokens": 2}'), None,
     400, "prompt[1]"),
    ("lone surrogate: chat message", "POST", CHAT,
     raw('{"messages": [{"role": "user", "content": "\\ud800abc"}], "max_tokens": 2}'), None, 400,
     "messages[0].content"),
    ("lone surrogate: text part", "POST", CHAT,
     raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}'), None, 400,
     "messages[0].content[0].text"),
    ("lone surrogate: stop", "POST", CMPL, raw('{"prompt": "x", "stop": ["\\ud83d"]}'), None, 400, "stop[0]"),
    ("lone surrogate: tokenize", "POST", "/tokenize", raw('{"prompt": "\\ud800"}'), None, 400, "prompt"),
    ("lone surrogate: key", "POST", CMPL, raw('{"prompt": "x", "\\ud800": 1}'), None, 400, "\\ud800"),
    ("non-UTF-8 Authorization", "GET", "/v1/models", b"", {"Authorization": b"Bearer \xff\xfe"}, 401, None),
    ("Latin-1 Authorization", "POST", CMPL, body(prompt="x"), {"Authorization": b"Bearer sekr\xe9t"}, 401, None),
    ("tokenize without the key", "POST", "/tokenize", body(prompt="hello"), {}, 401, None),
    ("detokenize without the key", "POST", "/detokenize", body(tokens=[1, 2]), {}, 401, None),
    ("tokenizer_info without the key", "GET", "/tokenizer_info", b"", {}, 401, None),
    ("too many stop strings", "POST", CMPL,
     body(prompt="x", stop=[f"s{i}" for i in range(LIMITS.max_stop_strings + 1)]), None, 400, "stop"),
    ("a stop string too long", "POST", CMPL, body(prompt="x", stop=["z" * (LIMITS.max_stop_chars + 1)]), None,
     400, "stop"),
    ("too many stop_token_ids", "POST", CMPL, body(prompt="x", stop_token_ids=[7] * (LIMITS.max_stop_token_ids + 1)),
     None, 400, "stop_token_ids"),
    ("too many logit_bias entries", "POST", CMPL,
     body(prompt="x", logit_bias={str(i): 1 for i in range(LIMITS.max_logit_bias + 1)}), None, 400, "logit_bias"),
    ("too many prompts", "POST", CMPL, body(prompt=["x"] * (LIMITS.max_prompts + 1), max_tokens=1), None, 400,
     "prompt"),
    ("10 MB prompt", "POST", CMPL, body(prompt="hello world " * 900_000), None, 400, "prompt"),
    ("10 MB chat message", "POST", CHAT, body(messages=[{"role": "user", "content": "hi " * 3_500_000}]), None,
     400, "messages"),
    ("10 MB tokenize", "POST", "/tokenize", body(prompt="hi " * 3_500_000), None, 400, "prompt"),
    ("max_tokens 0 without echo", "POST", CMPL, body(prompt="x", max_tokens=0), None, 400, "max_tokens"),
    ("max_tokens 0 in chat", "POST", CHAT, body(messages=USER, max_tokens=0), None, 400, "max_tokens"),
]


@pytest.fixture(scope="module")
def handle():
    h = tiny_handle(max_model_len=MAX_MODEL_LEN)
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def server(handle):
    with BackgroundServer(create_app(handle, api_key=KEY)) as srv:
        yield srv


@pytest.mark.parametrize("case,method,path,content,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_the_field(server, handle, case, method, path, content, headers, status, param):
    before = handle.stats().num_steps
    r = httpx.request(method, server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **(AUTH if headers is None else headers)})
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param:
        assert param.split("[")[0].split(".")[0] in err["message"]
    assert handle.stats().num_steps == before                 # refused before the engine saw it
    ok = httpx.post(server.url + CMPL, json={"prompt": "still serving", "max_tokens": 2}, headers=AUTH, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", [CMPL, CHAT, "/tokenize", "/detokenize", "/v1/load_lora_adapter",
                                  "/v1/unload_lora_adapter", "/reset_prefix_cache"])
def test_json_routes_take_json_bodies_only(server, handle, path):
    """A body that does not come as JSON (a form's or a plain text post, which a browser sends anywhere
    without asking first, or one with no Content-Type) is a 415 with an OpenAI error body before any route
    reads it; application/json (any case, with parameters) and +json types are read."""
    good = {CMPL: body(prompt="x", max_tokens=1), CHAT: body(messages=USER, max_tokens=1),
            "/tokenize": body(prompt="hi"), "/detokenize": body(tokens=[1, 2])}.get(path, b"{}")
    before = handle.stats().num_steps
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/jsonx", None):
        headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
        r = httpx.post(server.url + path, content=good, headers=headers, timeout=30)
        assert r.status_code == 415, (content_type, r.text[:300])
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "unsupported_media_type")
        assert "Content-Type: application/json" in err["message"] and repr(content_type or "none")[1:-1] in err["message"]
    assert handle.stats().num_steps == before
    if path in (CMPL, CHAT, "/tokenize", "/detokenize"):
        for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/merge+json"):
            r = httpx.post(server.url + path, content=good, headers={**AUTH, "content-type": content_type}, timeout=30)
            assert r.status_code == 200, (content_type, r.text[:300])


def test_open_routes_need_no_key_and_the_rest_do(server):
    for path in ("/health", "/version", "/metrics", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200, path
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0


def test_limits_are_configurable_and_checked_at_start(handle):
    small = ServerLimits(max_stop_strings=2, max_logit_bias=1, max_prompts=2)
    with BackgroundServer(create_app(handle, limits=small)) as srv:
        ok = httpx.post(srv.url + CMPL, json={"prompt": ["a", "b"], "stop": ["x", "y"], "logit_bias": {"5": 1},
                                              "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        for field, value in (("stop", ["x", "y", "z"]), ("logit_bias", {"5": 1, "6": 1}), ("prompt", ["a"] * 3)):
            r = httpx.post(srv.url + CMPL, json={"prompt": "a", "max_tokens": 1, field: value}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field
    for bad in (dict(max_prompts=0), dict(request_timeout=0), dict(drain_timeout=-1), dict(max_json_depth=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            create_app(handle, limits=ServerLimits(**bad))
