"""Property tests of structured output through a live server (CPU engine, tiny random-weight Qwen3 with
the real Qwen tokenizer: at temperature 1 it samples all over what a grammar allows). Generated regexes
and JSON schemas within the engine's limits give text that matches them — Python's `re.fullmatch` and
`jsonschema` are the oracles — for every seed and sample, on both endpoints, streamed or not (an output
cut by max_tokens is a prefix of a match); generated ones past the limits (counted repetitions of
millions, Lark rules of thousands of alternatives, schemas whose references recurse with no way out) are
a 400 naming the field, every time, streamed or not, never a 500 and never a 200."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import regex as partial_regex
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.config import EngineConfig
from engine.handle import EngineHandle
from harness.models import tiny_model_path
from server.app import create_app
from server.background import BackgroundServer

# the same examples on every run (no example database): each one is a few requests through the server
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server():
    handle = EngineHandle(EngineConfig(model=tiny_model_path("qwen3_tied"), device="cpu", max_model_len=512,
                                       num_kv_blocks=256, max_num_seqs=32))
    with BackgroundServer(create_app(handle)) as srv:
        yield srv
    handle.shutdown()


def generate(server, extra: dict, seed: int, stream: bool, chat: bool, max_tokens: int):
    """(status, [(text, finish_reason)] per sample, or the error body)."""
    body = {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "n": 3, "stream": stream, **extra}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Answer:"}]
    else:
        path, body["prompt"] = "/v1/completions", "Answer:"
    r = httpx.post(server.url + path, json=body, timeout=120)
    if r.status_code != 200:
        return r.status_code, r.json()
    if not stream:
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return 200, [((c["message"]["content"] if chat else c["text"]) or "", c["finish_reason"]) for c in choices]
    texts, finish = {}, {}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + ((c["delta"].get("content") if chat else c["text"]) or "")
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    return 200, [(texts[i], finish[i]) for i in sorted(texts)]


def refused_every_time(server, extra: dict, param: str) -> None:
    messages = set()
    for i, stream in enumerate((False, True, False)):
        status, got = generate(server, extra, seed=i, stream=stream, chat=bool(i % 2), max_tokens=8)
        assert status == 400, (extra if len(json.dumps(extra)) < 300 else param, status, got)
        assert got["error"]["param"] == param, got
        messages.add(got["error"]["message"])
    assert len(messages) == 1, messages


# -- regexes: the subset where Rust's syntax (llguidance) and Python's mean the same ------------------------
LITERAL = st.sampled_from(list("abcxyz019 -_"))
CLASS = st.sampled_from(["[a-c]", "[0-9]", "[xyz]", "[A-Z]", "[^a-z]", "."])


def _quantified(inner: st.SearchStrategy) -> st.SearchStrategy:
    bound = st.integers(0, 3).flatmap(lambda m: st.sampled_from([f"{{{m}}}", f"{{{m},{m + 2}}}", "?", "*", "+"]))
    return st.tuples(inner, bound).map(lambda t: f"({t[0]}){t[1]}")


REGEX = st.recursive(
    st.one_of(LITERAL, CLASS),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=4).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        _quantified(inner)),
    max_leaves=8)


@pytest.mark.slow
@settings(max_examples=20, **SETTINGS)
@given(pattern=REGEX, seed=st.integers(0, 2**31 - 1), stream=st.booleans(), chat=st.booleans())
def test_generated_regexes_always_match(server, pattern, seed, stream, chat):
    status, samples = generate(server, {"guided_regex": pattern}, seed, stream, chat, max_tokens=24)
    assert status == 200, (pattern, samples)
    for text, finish in samples:
        if finish == "stop":
            assert re.fullmatch(pattern, text), (pattern, text)
        else:
            assert finish == "length" and partial_regex.fullmatch(pattern, text, partial=True), (pattern, text, finish)


# -- JSON schemas ---------------------------------------------------------------------------------------------
NAMES = st.sampled_from(["a", "b", "name", "n_1", "x y"])
LEAF = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}), st.just({"type": "null"}), st.just({"type": "number"}),
    st.integers(0, 6).map(lambda k: {"type": "string", "maxLength": k}),
    st.sampled_from(["^[a-z]{1,4}$", "^[0-9]+-[A-Z]$"]).map(lambda p: {"type": "string", "pattern": p}),
    st.lists(st.one_of(st.text("abc", max_size=3), st.integers(0, 9)), min_size=1, max_size=4, unique=True).map(
        lambda xs: {"enum": xs}))


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict, data) -> dict:
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []}
    return st.tuples(st.dictionaries(NAMES, children, max_size=3), st.data()).map(lambda t: build(*t))


SCHEMA = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}),
        _object(inner),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs})),
    max_leaves=6)


@pytest.mark.slow
@settings(max_examples=20, **SETTINGS)
@given(schema=SCHEMA, seed=st.integers(0, 2**31 - 1), stream=st.booleans(), chat=st.booleans())
def test_generated_json_schemas_always_validate(server, schema, seed, stream, chat):
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    status, samples = generate(server, fmt if chat else {"guided_json": schema}, seed, stream, chat, max_tokens=96)
    assert status == 200, (schema, samples)
    for text, finish in samples:
        if finish == "stop":
            jsonschema.validate(json.loads(text), schema)
        else:
            assert finish == "length", (schema, text, finish)


# -- past the engine's limits ---------------------------------------------------------------------------------
WORD = st.text("abcdxyz", min_size=1, max_size=5)
HUGE_REGEX = st.one_of(
    st.tuples(WORD, st.integers(10**6, 10**8)).map(lambda t: f"({t[0]}){{{t[1]}}}"),
    st.tuples(WORD, st.integers(1000, 5000), st.integers(1000, 5000)).map(lambda t: f"({t[0]}){{{t[1]}}}{{{t[2]}}}"),
    st.tuples(WORD, st.integers(10**6, 10**8), WORD).map(lambda t: f"{t[0]}-({t[2]}){{{t[1]}}}"))


@pytest.mark.slow
@settings(max_examples=5, **SETTINGS)
@given(pattern=HUGE_REGEX)
def test_regexes_past_the_limits_are_400_every_time(server, pattern):
    refused_every_time(server, {"guided_regex": pattern}, "guided_regex")


@settings(max_examples=5, **SETTINGS)
@given(n=st.integers(2001, 6000), rules=st.booleans(), word=WORD)
def test_lark_rules_past_the_limits_are_400_every_time(server, n, rules, word):
    if rules:
        lark = "start: " + " | ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(
            f'r{i}: "{word}{i}"' for i in range(n))
    else:
        lark = "start: " + " | ".join(f'"{word}{i}"' for i in range(n))
    refused_every_time(server, {"guided_grammar": lark}, "guided_grammar")


def _recursive(data) -> dict:
    """A schema whose references recurse with no way out: a chain of definitions, each needing the next
    (a required property, or an array of at least one), the last needing the first; optional siblings."""
    length = data.draw(st.integers(1, 3))
    names = [f"d{i}" for i in range(length)]
    defs = {}
    for i, name in enumerate(names):
        ref = {"$ref": f"#/$defs/{names[(i + 1) % length]}"}
        key = data.draw(NAMES)
        if data.draw(st.booleans()):
            defs[name] = {"type": "array", "items": ref, "minItems": data.draw(st.integers(1, 3))}
        else:
            extra = {"other": data.draw(LEAF)} if data.draw(st.booleans()) else {}
            defs[name] = {"type": "object", "properties": {**extra, key: ref}, "required": [key]}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@settings(max_examples=8, **SETTINGS)
@given(data=st.data())
def test_schemas_that_recurse_with_no_way_out_are_400_every_time(server, data):
    schema = _recursive(data)
    refused_every_time(server, {"guided_json": schema}, "guided_json")
    refused_every_time(server, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema}}}, "response_format.json_schema.schema")
