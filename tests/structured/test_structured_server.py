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


def test_required_tool_calls_end_when_the_array_closes(client, handle):
    """tool_choice required with the default parallel_tool_calls: a model that would rather go on (its
    end-of-text suppressed) still stops once the JSON array of calls closes — finish_reason "tool_calls",
    every call whole and within its tool's schema, no raw call text in content; a call cut off by
    max_tokens is dropped, never left as content. `parallel_tool_calls: null` is the default."""
    no_eos = {str(t): -100 for t in handle.tokenizer.eos_token_ids}
    schemas = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}
    for seed in range(3):
        reply = client.chat.completions.create(model="qwen3_tied", messages=USER, tools=[WEATHER, TIME],
                                               tool_choice="required", max_tokens=200, seed=seed, temperature=1.0,
                                               logit_bias=no_eos, extra_body={"parallel_tool_calls": None})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert choice.message.tool_calls and reply.usage.completion_tokens < 200
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), {**schemas[call.function.name],
                                                                      "additionalProperties": False})
    cut = client.chat.completions.create(model="qwen3_tied", messages=USER, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=12, temperature=0.0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    assert not cut.choices[0].message.tool_calls


def test_named_tool_choice_is_the_arguments_and_finishes_stop(client, handle):
    """A named function (vLLM's, OpenAI's): the output is its arguments object, ended by the grammar;
    finish_reason "stop"; streamed, the same call in one delta."""
    args = dict(model="qwen3_tied", messages=USER, tools=[WEATHER, TIME], max_tokens=100, temperature=1.0, seed=3,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                logit_bias={str(t): -100 for t in handle.tokenizer.eos_token_ids})
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    deltas = [(c.choices[0].delta.tool_calls, c.choices[0].finish_reason)
              for c in client.chat.completions.create(**args, stream=True) if c.choices]
    calls = [d.function for tool_calls, _ in deltas for d in tool_calls or []]
    assert [(f.name, f.arguments) for f in calls] == [(call.function.name, call.function.arguments)]
    assert deltas[-1][1] == "stop"


def test_langchain_structured_output_and_named_tool(server, handle):
    """langchain-openai's with_structured_output(method="function_calling") and bind_tools(tool_choice=NAME):
    a named tool choice over a pydantic schema, which leaves extra keys open. A model that would rather not
    close the object (every token with a "}" biased away) pads it with keys where the schema lets it; the
    call is held to the tool's keys, ends when complete, and each returns it."""
    pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        """A weather forecast request."""
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)

    tok = handle.tokenizer
    no_close = {str(i): -100 for i in range(tok.tok.get_vocab_size()) if "}" in tok.decode([i])}
    llm = ChatOpenAI(model="qwen3_tied", base_url=server.url + "/v1", api_key="unused", max_tokens=100,
                     temperature=1.0, seed=5, max_retries=0, logit_bias=no_close)
    forecast = llm.with_structured_output(Forecast, method="function_calling").invoke("Weather in Paris?")
    assert isinstance(forecast, Forecast) and 1 <= forecast.days <= 7
    message = llm.bind_tools([Forecast], tool_choice="Forecast").invoke("Weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "Forecast" and set(call["args"]) <= {"city", "days"}
    Forecast(**call["args"])


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


# the grammars of issue 51: they compiled, then went past llguidance's limits at their first tokens (the
# schema admits no finite value: its matcher recursed until a limit)
PAST_LIMITS = [
    ({"guided_regex": "a{1000}{1000}"}, "guided_regex", "lexer error"),
    ({"guided_regex": "a{1000000}"}, "guided_regex", "lexer error"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema", "'$ref' '#' recurses with no way out"),
    ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(5000))}, "guided_grammar", "max is 2000"),
]


@pytest.mark.parametrize("extra,param,words", PAST_LIMITS,
                         ids=["regex-nested-counts", "regex-million", "schema-recursion", "lark-5000"])
def test_grammars_past_the_engines_limits_are_400_every_time(server, handle, monkeypatch, extra, param, words):
    """Refused before the engine sees them (never a 500, never a 200 with text that does not match), on
    both endpoints, streamed or not, the first time and every time after, with the same reason."""
    submitted, messages = [], set()
    monkeypatch.setattr(handle, "submit", lambda req: submitted.append(req))
    for path, body in (("/v1/chat/completions", chat(**extra)), ("/v1/completions", {"prompt": "x", **extra})):
        for stream in (False, True, False):
            r = httpx.post(server.url + path, json={**body, "max_tokens": 8, "temperature": 1.0, "stream": stream},
                           timeout=60)
            assert r.status_code == 400, (path, stream, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err
            messages.add(err["message"])
    assert submitted == [] and len(messages) == 1, messages


def test_a_new_grammar_compiles_once_for_its_check_and_its_requests(server, handle, monkeypatch):
    """The server's check and the engine's admission share the engine's grammar cache: one compile for
    requests arriving together and after (issue 54: it was one in the server's cache and one in the
    engine's)."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.grammar import GrammarCache
    built = []
    build = GrammarCache._build
    monkeypatch.setattr(GrammarCache, "_build", lambda self, g: (built.append(g), build(self, g))[1])
    body = {"prompt": "Code:", "max_tokens": 12, "temperature": 1.0, "guided_regex": r"[0-9]{3}-once-[a-z]{2}"}

    def post(seed: int) -> str:
        r = httpx.post(server.url + "/v1/completions", json={**body, "seed": seed}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(post, range(4)))
    texts.append(post(4))
    assert all(re.fullmatch(body["guided_regex"], t) for t in texts), texts
    assert built == [grammar_of(body)]


def grammar_of(body: dict) -> str:
    return structured.parse_constraint(body).grammar


def test_a_check_over_the_time_limit_is_a_400_every_time(server, monkeypatch):
    """A grammar whose compile and probe outlast CHECK_TIME_LIMIT_S is refused, and stays refused once
    the slow check has finished (made slow on purpose: a real one's time races the limit); the server
    stops waiting after CHECK_WAIT_S."""
    import time

    from engine import grammar
    probe = grammar.probe
    monkeypatch.setattr(grammar, "probe", lambda m, eos: (time.sleep(1.0), probe(m, eos))[1])
    monkeypatch.setattr(grammar, "CHECK_TIME_LIMIT_S", 0.5)
    monkeypatch.setattr(structured, "CHECK_WAIT_S", 0.2)
    body = chat(guided_regex="[a-z]{3}-slow")
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "took longer than 0.2 s" in r.json()["error"]["message"], r.text
    time.sleep(1.5)                                 # the check finishes meanwhile: over the limit
    monkeypatch.setattr(structured, "CHECK_WAIT_S", 30.0)
    for _ in range(2):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "took longer than 0.5 s" in r.json()["error"]["message"], r.text


def test_a_grammar_failing_mid_generation_is_an_engine_error_then_a_400(server, monkeypatch):
    """Where a matcher fails while generating (the probe skipped, so a grammar past the limits reaches the
    engine), the request ends as other engine failures do: a 500 `engine_error` naming the grammar's
    error, or streamed, an error chunk and [DONE] with no finish_reason; never a 200 with text the
    grammar does not match. The grammar is refused (400) from then on."""
    from engine import grammar
    monkeypatch.setattr(grammar, "PROBE_WALKS", 0)
    body = {"prompt": "x", "max_tokens": 8, "temperature": 1.0, "guided_regex": "b{2000000}"}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    assert "structured output failed: lexer error" in r.json()["error"]["message"]
    body["guided_regex"] = "c{2000000}"
    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]") and "structured output failed" in events[-1]["error"]["message"]
    assert all(c["finish_reason"] is None and c["text"] == "" for e in events[:-1] for c in e["choices"]), events
    for regex in ("b{2000000}", "c{2000000}"):
        for stream in (False, True):
            r = httpx.post(server.url + "/v1/completions", json={**body, "guided_regex": regex, "stream": stream},
                           timeout=60)
            assert r.status_code == 400 and "while generating: lexer error" in r.json()["error"]["message"], r.text
