"""Tool-call parsing (server/tool_calls.py) and the tool grammars (server/tools.py), without an engine:
streamed in any chunking the deltas carry what the whole-text parse finds; Llama 3's JSON form; the
grammars accept the model's format and refuse other functions; the real Qwen template renders tools."""
from __future__ import annotations

import json
import random

import pytest

from engine.grammar import GrammarCache
from server.tool_calls import ToolCallStream, parse_output
from server.tools import ToolConfig, parse_tools, tool_format

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


def test_grammars_accept_the_format_and_refuse_other_functions(qwen):
    cache = GrammarCache(qwen, None, qwen.eos_token_ids)
    one_call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    cases = [(ToolConfig(TOOLS, "required", None, True, "hermes", True), QWEN_OUT.split("\n", 1)[1], True),
             (ToolConfig(TOOLS, "required", None, False, "hermes", True), QWEN_OUT.split("\n", 1)[1], False),
             (ToolConfig(TOOLS, "named", "now", True, "hermes", True), one_call, True),
             (ToolConfig(TOOLS, "named", "get_weather", True, "hermes", True), one_call, False),
             (ToolConfig(TOOLS, "required", None, True, "llama3_json", False),
              '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}', True)]
    for config, text, ok in cases:
        matcher = cache.matcher(config.grammar())
        ids = qwen.encode(text, add_special_tokens=False)
        accepted = all(matcher.accept(t) for t in ids)
        assert accepted == ok and (not ok or matcher.m.is_accepting()), (config.choice, config.format, text)


def test_qwen_template_renders_tools_and_the_format_is_read_off_it(qwen):
    assert tool_format(qwen) == "hermes"
    config = parse_tools({"tools": TOOLS}, qwen)
    assert config.choice == "auto" and config.tag_tokens and config.grammar() is None
    prompt = qwen.apply_chat_template([{"role": "user", "content": "hi"}], tools=config.template_tools)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, qwen).template_tools is None
    assert parse_tools({}, qwen) is None
