"""Reasoning output (`--reasoning-parser`, server/reasoning.py) and `chat_template_kwargs`.

The split is checked against vLLM's definition (its qwen3 / deepseek_r1 `extract_reasoning`: the text
after <think> and before </think> is reasoning, the rest content; where the prompt's template already
closed the block everything is content), streamed in every chunking; through the server with a scripted
engine whose 'model' writes a given text a few bytes per token (tags split across tokens), read by the
official openai client; and on the real engine with the real Qwen tokenizer given Qwen3's think tokens and
a Qwen3 chat template (the real ChatML template with Qwen3's enable_thinking switch), against transformers'
own rendering of that template.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil

import httpx
import openai
import pytest

from fake_handle import ByteTokenizer, FakeHandle, ScriptedHandle
from server.app import create_app
from server.background import BackgroundServer
from server.cli import build_parser
from server.reasoning import CLOSE_TAG, CONTENT, OPEN, OPEN_TAG, REASONING, ReasoningStream

QWEN3_TOKENS = {151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>", 151668: "</think>"}
THINK_SWITCH = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


def vllm_split(text: str, start: str) -> tuple[str | None, str | None]:
    """vLLM's non-streamed split (qwen3 / deepseek_r1 extract_reasoning) where the prompt left the output in
    `start`: closed by the template -> all content; else the text after the first <think> (qwen3: only where
    the model opened one) is reasoning up to the first </think>, content after it."""
    if start == CONTENT:
        return None, text
    _, opened, rest = text.partition(OPEN_TAG)
    if start == OPEN and not opened:
        return None, text
    reasoning, ended, content = (rest if opened else text).partition(CLOSE_TAG)
    return reasoning or None, (content or None) if ended else None


def stream_split(text: str, start: str, seed: int) -> tuple[str | None, str | None]:
    rng, stream, pieces, at = random.Random(seed), ReasoningStream(start), [], 0
    while at < len(text):
        n = 1 if seed == 0 else rng.randint(1, 6)
        pieces += stream.feed(text[at:at + n])
        at += n
    pieces += stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == REASONING)
    return reasoning or None, "".join(t for kind, t in pieces if kind == CONTENT) or None


@pytest.mark.parametrize("start,text", [
    (OPEN, "<think>\nThe capital is Paris.\n</think>\n\nParis."),        # Qwen3, thinking
    (OPEN, "Paris."),                                                    # Qwen3, no block
    (OPEN, "<think>\ncut off before the end"),                           # max_tokens inside the block
    (OPEN, "<think>a</think>b<think>c</think>"),                         # one block: later tags are content
    (REASONING, "I should answer.\n</think>\n\nParis."),                 # the template opened it (R1, Qwen3.5)
    (REASONING, "<think>x < y and </thinking> is no tag</think>done"),   # R1 writing its own opening tag
    (REASONING, "cut off at <thi"),                                      # a tag's start held back, then flushed
    (CONTENT, "Paris. </think> <think> stay content"),                   # enable_thinking false: closed
])
def test_split_is_vllms_in_every_chunking(start, text):
    want = vllm_split(text, start)
    for seed in range(12):
        assert stream_split(text, start, seed) == want


def test_reasoning_tokens_are_the_tokens_inside_the_block():
    stream = ReasoningStream(OPEN)
    for token in ["<think>", "\n", "Let", " me", " see", "</think>", "\n\n", "Paris"]:
        stream.feed(token)
    assert stream.tokens == 4           # "\n", "Let", " me", " see": as vLLM counts them


class ThinkingTemplate(ByteTokenizer):
    """A Qwen3-like template over the byte tokenizer: with enable_thinking false the generation prompt closes
    an empty block; `opens` makes it open one (DeepSeek-R1, Qwen3.5)."""

    def __init__(self, opens: bool = False):
        self.opens = opens

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, enable_thinking=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>" + ("<think>\n\n</think>\n\n" if not enable_thinking else
                                     "<think>\n" if self.opens else "")
        return text


@contextlib.contextmanager
def scripted(parser: str, opens: bool = False):
    """(the scripted engine, an openai client of a server over it with `parser`)."""
    handle = ScriptedHandle()
    handle.tokenizer = ThinkingTemplate(opens)
    with BackgroundServer(create_app(handle, reasoning_parser=parser)) as srv:
        yield handle, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


USER = [{"role": "user", "content": "capital of France?"}]
THINKING = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def chat_both_ways(client, **kwargs) -> tuple[dict, dict]:
    """The non-streamed message and the streamed deltas joined, as the client reads them."""
    message = client.chat.completions.create(model="fake-model", messages=USER, **kwargs).choices[0].message
    joined: dict = {}
    for chunk in client.chat.completions.create(model="fake-model", messages=USER, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        for key in ("content", "reasoning_content", "reasoning"):
            value = getattr(delta, key, None) if key == "content" else (delta.model_extra or {}).get(key)
            if value:
                joined[key] = joined.get(key, "") + value
        for call in delta.tool_calls or []:
            joined.setdefault("tool_calls", []).append((call.function.name, call.function.arguments))
    return message.model_dump(), joined


def test_chat_splits_reasoning_streamed_and_whole():
    with scripted("qwen3") as (handle, client):
        handle.script = THINKING
        reasoning, content = vllm_split(THINKING, OPEN)
        message, streamed = chat_both_ways(client)
        assert (message["reasoning_content"], message["reasoning"], message["content"]) == (reasoning, reasoning, content)
        assert streamed == {"reasoning_content": reasoning, "reasoning": reasoning, "content": content}
        handle.script = "No thinking here."
        message, streamed = chat_both_ways(client)
        assert message["content"] == handle.script and message["reasoning_content"] is None
        assert streamed == {"content": handle.script}
        handle.script = "<think>\nhidden\n</think>\n\nshown"
        message, streamed = chat_both_ways(client, extra_body={"include_reasoning": False})
        assert message["content"] == "\n\nshown" and "reasoning_content" not in message
        assert streamed == {"content": "\n\nshown"}


def test_tool_calls_are_parsed_in_the_content_only():
    with scripted("qwen3") as (handle, client):
        inner = '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        outer = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        handle.script = f"<think>\nMaybe {inner}? No.\n</think>\n\n{outer}"
        message, streamed = chat_both_ways(client, tools=[WEATHER])
        assert message["reasoning_content"] == f"\nMaybe {inner}? No.\n" == streamed["reasoning_content"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
            == [("weather", {"city": "Paris"})]
        assert [(n, json.loads(a)) for n, a in streamed["tool_calls"]] == [("weather", {"city": "Paris"})]
        assert message["content"] is None and "content" not in streamed


def test_the_prompts_end_decides_where_the_output_starts():
    with scripted("deepseek_r1", opens=True) as (handle, client):
        handle.script = "Paris is the capital.\n</think>\n\nParis."
        message, streamed = chat_both_ways(client)
        assert (message["reasoning_content"], message["content"]) == vllm_split(handle.script, REASONING)
        assert streamed["reasoning_content"] == message["reasoning_content"]
        handle.script = "Paris."        # enable_thinking false: the template closes the block, all is content
        message, streamed = chat_both_ways(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert ByteTokenizer().decode(handle.submitted[-1].prompt_token_ids.tolist()).endswith("<think>\n\n</think>\n\n")
        assert (message["reasoning_content"], message["content"]) == (None, "Paris.")
        assert streamed == {"content": "Paris."}


def test_responses_api_gives_a_reasoning_item_then_the_message():
    with scripted("qwen3") as (handle, client):
        handle.script = THINKING
        reasoning, content = vllm_split(THINKING, OPEN)
        out = client.responses.create(model="fake-model", input="capital of France?")
        assert [item.type for item in out.output] == ["reasoning", "message"]
        assert out.output[0].content[0].text == reasoning and out.output_text == content
        assert out.usage.output_tokens_details.reasoning_tokens > 0
        with client.responses.stream(model="fake-model", input="capital of France?") as stream:
            deltas = [(e.type, e.delta) for e in stream if e.type.endswith("text.delta")]
            final = stream.get_final_response()
        assert "".join(d for t, d in deltas if t == "response.reasoning_text.delta") == reasoning
        assert "".join(d for t, d in deltas if t == "response.output_text.delta") == content == final.output_text


def test_a_parser_is_checked_at_start(tmp_path):
    with pytest.raises(ValueError, match="not one of"):
        create_app(FakeHandle(), reasoning_parser="qwen9")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "qwen9"])
    assert build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    from engine.tokenizer import Tokenizer
    folder = qwen_folder()
    with pytest.raises(ValueError, match="no <think>"):          # Qwen2.5's vocabulary: no think tokens
        create_app(tokenizer_handle(Tokenizer.from_folder(folder)), reasoning_parser="qwen3")
    create_app(tokenizer_handle(Tokenizer.from_folder(qwen3_tokenizer(folder, str(tmp_path)))), reasoning_parser="qwen3")


def tokenizer_handle(tokenizer) -> FakeHandle:
    handle = FakeHandle()
    handle.tokenizer = tokenizer
    return handle


# -- the real engine, the real Qwen tokenizer with Qwen3's think tokens and a Qwen3 chat template ---------

def qwen_folder() -> str:
    from harness.models import qwen_tokenizer_dir
    folder = qwen_tokenizer_dir()
    if folder is None:
        pytest.skip("needs the real Qwen tokenizer (shared/models/qwen-tokenizer)")
    return folder


def qwen3_tokenizer(source: str, out: str) -> str:
    """Write into `out` the Qwen tokenizer with Qwen3's four added tokens at their ids (in place of the GGUF
    vocabulary's padding entries) and the ChatML template with Qwen3's enable_thinking switch after the
    generation prompt, as Qwen3's own template has it."""
    with open(os.path.join(source, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    for token_id, text in QWEN3_TOKENS.items():
        del tok["model"]["vocab"][f"[PAD{token_id}]"]
        tok["model"]["vocab"][text] = token_id
        tok["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f)
    shutil.copy(os.path.join(source, "tokenizer_config.json"), out)
    with open(os.path.join(source, "chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    generation = "{{- '<|im_start|>assistant\\n' }}"
    assert template.count(generation) == 1
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template.replace(generation, generation + THINK_SWITCH))
    return out


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    from harness.models import tiny_model_path
    source = qwen_folder()
    folder = str(tmp_path_factory.mktemp("qwen3_thinking"))
    shutil.copytree(tiny_model_path("qwen3_tied"), folder, dirs_exist_ok=True)
    return qwen3_tokenizer(source, folder)


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_model):
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    handle = EngineHandle(EngineConfig(model=qwen3_model, device="cpu", max_model_len=256, num_kv_blocks=64))
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def live(qwen3_engine):
    with BackgroundServer(create_app(qwen3_engine, served_model_name="qwen3", reasoning_parser="qwen3")) as srv:
        yield srv


def test_chat_template_kwargs_reach_the_template(qwen3_engine, qwen3_model):
    from transformers import AutoTokenizer
    oracle = AutoTokenizer.from_pretrained(qwen3_model)
    with BackgroundServer(create_app(qwen3_engine)) as srv:         # no reasoning parser: the template alone
        for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            want = oracle.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)
            ids = httpx.post(srv.url + "/tokenize", json={"messages": USER, "chat_template_kwargs": kwargs}).json()
            assert ids["tokens"] == oracle.encode(want, add_special_tokens=False)
            reply = httpx.post(srv.url + "/v1/chat/completions", json={
                "messages": USER, "max_tokens": 1, "chat_template_kwargs": kwargs}).json()
            assert reply["usage"]["prompt_tokens"] == ids["count"]
        assert want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": [1]})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "chat_template_kwargs"
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"messages": USER,
                                                                 "chat_template_kwargs": {"tools": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_real_think_tokens_split_as_the_raw_output_reads(live):
    """A grammar makes the tiny random model write a think block in Qwen3's own tokens; the completions
    route (no parser) gives the raw text of the same prompt, which vLLM's split must match."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    grammar = "start: <think> /[a-z ]{3,12}/ </think> /[a-z ]{3,12}/"      # the tags as Qwen3's tokens
    prompt = httpx.post(live.url + "/tokenize", json={"messages": USER}).json()["tokens"]
    raw = client.completions.create(model="qwen3", prompt=prompt, max_tokens=40, temperature=0,
                                    extra_body={"guided_grammar": grammar, "skip_special_tokens": False})
    raw_text = raw.choices[0].text
    assert raw_text.startswith(OPEN_TAG) and CLOSE_TAG in raw_text
    reasoning, content = vllm_split(raw_text, OPEN)
    kwargs = dict(model="qwen3", messages=USER, max_tokens=40, temperature=0,
                  extra_body={"guided_grammar": grammar})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks) == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
