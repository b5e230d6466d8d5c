"""Structured output and tool calls through a live server (CPU engine, tiny random-weight Qwen3 with the
real Qwen tokenizer and chat template), driven by the official `openai` client: its typed responses
parse what the server sends; schemas validate; tool calls round-trip through the template; a grammar
that cannot compile is a 400 naming its field, before the engine sees the request."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from engine.config import EngineConfig
from engine.handle import EngineHandle
from harness.models import tiny_model_path
from server import structured
from server.app import create_app
from server.background import BackgroundServer

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                         "unit": {"enum": ["C", "F"]}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def handle():
    h = EngineHandle(EngineConfig(model=tiny_model_path("qwen3_tied"), device="cpu", max_model_len=512,
                                  num_kv_blocks=256, max_num_seqs=32))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def server(handle):
    with BackgroundServer(create_app(handle)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_json_schema_and_json_object_validate(client):
    for seed in range(6):
        reply = client.chat.completions.create(
            model="qwen3_tied", messages=USER, max_tokens=80, seed=seed, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA, "strict": True}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    reply = client.chat.completions.create(model="qwen3_tied", messages=USER, max_tokens=200, seed=1,
                                           temperature=0.0, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_completions_vllm_fields_are_exact(client):
    pattern = r"[0-9]{3}-[a-z]{2}"
    cases = [({"guided_regex": pattern}, lambda t: re.fullmatch(pattern, t)),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
             ({"guided_grammar": 'root ::= "a" [0-9] [0-9]'}, lambda t: re.fullmatch(r"a[0-9]{2}", t)),
             ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
             ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True)]
    for extra, ok in cases:
        for seed in range(3):
            out = client.completions.create(model="qwen3_tied", prompt="Answer:", max_tokens=60, seed=seed,
                                            temperature=1.0, extra_body=extra)
            assert ok(out.choices[0].text), (extra, out.choices[0].text)


def test_required_tool_call_parses_streams_and_round_trips(client, server):
    args = dict(model="qwen3_tied", messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=False, max_tokens=120, seed=7, temperature=1.0)
    reply = client.chat.completions.create(**args)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    calls, finish = {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            got = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            got["name"] += delta.function.name or ""
            got["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}

    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    rendered = httpx.post(server.url + "/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": rendered}, timeout=30).json()["prompt"]
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}\n</tool_call>' in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    follow = client.chat.completions.create(model="qwen3_tied", messages=history, tools=[WEATHER, TIME],
                                            max_tokens=8, temperature=0.0)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_tool_choice_calls_that_function(client):
    for seed in range(4):
        reply = client.chat.completions.create(
            model="qwen3_tied", messages=USER, tools=[WEATHER, TIME], seed=seed, temperature=1.0, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_tool_choice_none_and_auto_answer(client):
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model="qwen3_tied", messages=USER, tools=[WEATHER], max_tokens=6,
                                               temperature=0.0, tool_choice=choice)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def chat(**extra) -> dict:
    return {"messages": USER, "max_tokens": 4, **extra}


BAD = [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format.json_schema.schema", "strin"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}),
     "response_format.json_schema.schema", "Unimplemented keys"),
    (chat(guided_json={"type": "string", "format": "foo"}), "guided_json", "Unknown format"),
    (chat(guided_json="{not json"), "guided_json", "not valid JSON"),
    (chat(guided_regex="[a-"), "guided_regex", "unclosed character class"),
    (chat(guided_grammar="start: nothing_here"), "guided_grammar", "unknown name"),
    (chat(guided_choice=[]), "guided_choice", "non-empty list"),
    (chat(guided_regex="a", guided_choice=["a"]), "guided_choice", "only one output constraint"),
    (chat(structured_outputs={"structural_tag": "x"}), "structured_outputs.structural_tag", "not supported"),
    (chat(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (chat(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (chat(tools=[WEATHER], tool_choice="required", guided_regex="a"), "guided_regex", "cannot be combined"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
          tool_choice="required"), "tools", "Unimplemented keys"),
    ({"prompt": "x", "tools": [WEATHER]}, "tools", "only supported on /v1/chat/completions"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[b[1] for b in BAD])
def test_bad_constraints_are_400_before_the_engine(server, handle, monkeypatch, body, param, words):
    submitted = []
    monkeypatch.setattr(handle, "submit", lambda req: submitted.append(req))
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code in (400, 422), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert submitted == []


def test_grammar_compile_timeout_is_a_400(server, monkeypatch):
    """A compile that outlasts COMPILE_TIMEOUT_S is a 400 (a slow compile made slow on purpose: a real
    one's time races the timeout)."""
    import time

    from engine.grammar import GrammarCache

    compile_ = GrammarCache.compile
    monkeypatch.setattr(GrammarCache, "compile", lambda self, g: (time.sleep(1.0), compile_(self, g))[1])
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.05)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x"}
                                               for i in range(40)}}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(guided_json=schema), timeout=30)
    assert r.status_code == 400 and "took longer than" in r.json()["error"]["message"], r.text
