"""Tool-call parsing (server/tool_calls.py) and the tool grammars (server/tools.py), without an engine:
streamed in any chunking the deltas carry what the whole-text parse finds; Llama 3's JSON form; the
grammars (vLLM's: a JSON array of calls for `required`, the arguments for a named function) accept the calls,
refuse other functions and extra keys, and end with the call; the real Qwen template renders tools."""
from __future__ import annotations

import json
import random

import pytest

import jsonschema

from engine.grammar import GrammarCache
from server.tool_calls import CallArrayStream, NamedCallStream, ToolCallStream, parse_output
from server.tools import ToolConfig, closed, parse_tools, tool_format

QWEN_OUT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "# {not a comment}"}},
    "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def stream_all(text: str, fmt: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    rng, s, deltas, at = random.Random(seed), ToolCallStream(fmt), [], 0
    while at < len(text):
        n = rng.randint(1, 9)
        deltas += s.feed(text[at:at + n])
        at += n
    deltas += s.finish()
    calls = [(d["tool_calls"][0]["function"]["name"], d["tool_calls"][0]["function"]["arguments"])
             for d in deltas if "tool_calls" in d]
    return "".join(d.get("content", "") for d in deltas), calls


@pytest.mark.parametrize("text,fmt", [
    (QWEN_OUT, "hermes"),
    ("Hello <tool_call> not json </tool_call> bye", "hermes"),
    ('<tool_call>\n{"name": "x", "arguments": {"a": [1, "<tool"]}}', "hermes"),
    ("  plain text, <tool no call\n", "hermes"),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "llama3_json"),
    ('<|python_tag|>{"name": "a", "arguments": {"x": "y"}}', "llama3_json"),
    ('Sure {"name": "a"}', "llama3_json"),
])
def test_stream_deltas_carry_what_the_whole_parse_finds(text, fmt):
    content, calls = parse_output(text, fmt)
    for seed in range(20):
        got_content, got_calls = stream_all(text, fmt, seed)
        assert got_content == (content or "")
        assert got_calls == [(c.name, c.arguments) for c in calls]


def test_parsed_calls_and_content():
    content, calls = parse_output(QWEN_OUT)
    assert content == "I will check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert len({c.id for c in calls}) == 2
    assert parse_output("Hello <tool_call> not json </tool_call> bye") == (
        "Hello <tool_call> not json </tool_call> bye", [])
    content, calls = parse_output('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
                                  "llama3_json")
    assert content is None and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]


@pytest.fixture(scope="module")
def qwen():
    from engine.tokenizer import Tokenizer
    from harness.models import qwen_tokenizer_dir
    folder = qwen_tokenizer_dir()
    if folder is None:
        pytest.skip("the Qwen tokenizer is not available")
    return Tokenizer.from_folder(folder)


def grammar_takes(cache, config: ToolConfig, text: str) -> tuple[bool, bool]:
    """(the grammar accepts every token of text, it is then complete: the engine ends the output there)."""
    matcher = cache.matcher(config.grammar())
    matcher.on_error = None             # a refusal here is the test's point, not the grammar's failure
    ok = all(matcher.accept(t) for t in cache.tokenizer.encode(text, add_special_tokens=False))
    return ok, ok and matcher.done


def test_required_and_named_grammars_are_vllms_and_end_with_the_call(qwen):
    """required: a JSON array of {name, parameters} (one item without parallel calls); named: the
    arguments object alone; both complete (nothing but the end may follow) once the JSON closes."""
    cache = GrammarCache(qwen, None, qwen.eos_token_ids)
    two = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    one = '[{"name": "now", "parameters": {}}]'
    cases = [(ToolConfig(TOOLS, "required", None, True, "hermes"), two, (True, True)),
             (ToolConfig(TOOLS, "required", None, True, "hermes"), one, (True, True)),
             (ToolConfig(TOOLS, "required", None, False, "hermes"), two, (False, False)),
             (ToolConfig(TOOLS, "required", None, False, "hermes"), one, (True, True)),
             (ToolConfig(TOOLS, "required", None, True, "llama3_json"), one, (True, True)),
             (ToolConfig(TOOLS, "required", None, True, "hermes"), '[{"name": "sleep", "parameters": {}}]',
              (False, False)),
             (ToolConfig(TOOLS, "named", "get_weather", True, "hermes"), '{"city": "Oslo"}', (True, True)),
             (ToolConfig(TOOLS, "named", "now", True, "hermes"), "{}", (True, True)),
             (ToolConfig(TOOLS, "named", "get_weather", True, "hermes"), '{"city": "Oslo", "when": 1}',
              (False, False))]
    for config, text, expected in cases:
        assert grammar_takes(cache, config, text) == expected, (config.choice, config.parallel, text)


def test_tool_schemas_admit_no_keys_the_tool_does_not_take(qwen):
    """An object that lists its properties is closed where its schema leaves that open (jsonschema the
    oracle: the closed schema accepts a subset, and refuses the padded call); free-form objects, objects
    that say `additionalProperties` and allOf parts stay as they were; $defs of tools move to the root."""
    nested = {"type": "object", "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}},
                                               "tags": {"type": "array", "items": {"type": "object", "properties": {
                                                   "k": {"type": "string"}}}},
                                               "extra": {"type": "object"},
                                               "open": {"type": "object", "properties": {}, "additionalProperties": True},
                                               "unit": {"$ref": "#/$defs/unit"}},
              "$defs": {"unit": {"type": "object", "properties": {"u": {"enum": ["C", "F"]}}}}}
    good = {"where": {"city": "Oslo"}, "tags": [{"k": "v"}], "extra": {"any": 1}, "open": {"x": 2}, "unit": {"u": "C"}}
    padded = [{**good, "more": 1}, {**good, "where": {"city": "Oslo", "zip": "1"}}, {**good, "tags": [{"k": "v", "n": 1}]},
              {**good, "unit": {"u": "C", "v": 1}}]
    tight = closed(nested)
    jsonschema.validate(good, nested)
    jsonschema.validate(good, tight)
    for instance in padded:
        jsonschema.validate(instance, nested)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, tight)
    assert closed({"allOf": [{"properties": {"a": {}}}], "properties": {"b": {}}}) == {
        "allOf": [{"properties": {"a": {}}}], "properties": {"b": {}}}
    assert "additionalProperties" not in nested                        # the request's schema is not changed
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested}}, *TOOLS]
    schema = ToolConfig(tools, "required").schema()
    assert schema["$defs"] == {"unit": tight["$defs"]["unit"]} and '"$defs":' not in json.dumps(schema["items"])
    call = [{"name": "f", "parameters": good}, {"name": "now", "parameters": {}}]
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": padded[-1]}], schema)
    cache = GrammarCache(qwen, None, qwen.eos_token_ids)
    assert grammar_takes(cache, ToolConfig(tools, "required"), json.dumps(call)) == (True, True)


@pytest.mark.parametrize("text", [
    '[{"name": "get_weather", "parameters": {"city": "a]}\\"{"}}, {"name": "now", "parameters": {}}]',
    '[{"name": "now", "parameters": {"deep": [{"x": "}"}, []]}}]',
    '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"ci',     # cut by max_tokens
])
def test_required_call_array_streams_each_whole_call(text):
    whole = json.loads(text) if text.endswith("]") else json.loads(text[:text.rindex("}, {") + 1] + "]")
    expected = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in whole]
    for seed in range(20):
        rng, stream, deltas, at = random.Random(seed), CallArrayStream(), [], 0
        while at < len(text):
            n = rng.randint(1, 9)
            deltas += stream.feed(text[at:at + n])
            at += n
        deltas += stream.finish()
        assert all("content" not in d for d in deltas)
        got = [(d["tool_calls"][0]["function"]["name"], d["tool_calls"][0]["function"]["arguments"]) for d in deltas]
        assert got == expected and [d["tool_calls"][0]["index"] for d in deltas] == list(range(len(expected)))


def test_named_call_is_its_arguments_object():
    stream = NamedCallStream("get_weather")
    assert stream.feed('{"city": ') == [] and stream.feed('"Paris"}') == []
    (delta,) = stream.finish()
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    cut = NamedCallStream("get_weather")
    cut.feed('{"city": "Pa')
    assert cut.finish() == [] and cut.calls == []


def test_qwen_template_renders_tools_and_the_format_is_read_off_it(qwen):
    assert tool_format(qwen) == "hermes"
    config = parse_tools({"tools": TOOLS}, qwen)
    assert config.choice == "auto" and config.grammar() is None
    prompt = qwen.apply_chat_template([{"role": "user", "content": "hi"}], tools=config.template_tools)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, qwen).template_tools is None
    assert parse_tools({}, qwen) is None
