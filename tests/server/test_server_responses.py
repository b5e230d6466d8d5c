"""POST /v1/responses, checked with the official openai client (`client.responses.create` / `.stream`, whose
stream helper refuses an event out of order) and against its types (every body and event validated as the
client's pydantic models): a scripted engine for the shapes and the input items' mapping (the prompt
equals the chat route's for the same conversation), the real engine (tiny Qwen3, the real Qwen template)
for function calls, their round trip as input items, and json_schema output."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from fake_handle import ByteTokenizer, FakeHandle, ScriptedHandle, expected_text
from server.app import create_app
from server.background import BackgroundServer

EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def handle():
    return ScriptedHandle()


@pytest.fixture(scope="module")
def server(handle):
    with BackgroundServer(create_app(handle)) as srv:
        yield srv


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def sse_events(url: str, body: dict) -> list[dict]:
    """The streamed events, each checked as the client's type and its `event:` line."""
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_text_reply_streamed_and_whole(server, handle):
    client = sdk(server.url)
    handle.script = "Paris is the capital of France."
    body = {"model": "fake-model", "input": "capital of France?", "instructions": "be brief", "temperature": 0.5}
    whole = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    Response.model_validate(whole)
    assert whole["id"].startswith("resp_") and whole["object"] == "response" and whole["status"] == "completed"
    assert whole["instructions"] == "be brief" and whole["temperature"] == 0.5 and whole["store"] is False
    [message] = whole["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": handle.script, "annotations": [], "logprobs": []}]
    prompt = ByteTokenizer().apply_chat_template([{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "capital of France?"}])
    assert handle.submitted[-1].prompt_token_ids.tolist() == ByteTokenizer().encode(prompt)
    assert handle.submitted[-1].params.temperature == 0.5
    usage = whole["usage"]
    assert usage["input_tokens"] == len(prompt) and 1 <= usage["output_tokens"] <= len(handle.script)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    events = sse_events(server.url, body)
    assert [e["type"] for e in events[:4] + events[-4:]] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert {e["type"] for e in events[4:-4]} == {"response.output_text.delta"}
    assert "".join(e["delta"] for e in events[4:-4]) == handle.script == events[-4]["text"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final["output"][0]["content"] == message["content"] and final["usage"] == usage
    with client.responses.stream(**body) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == handle.script
        assert stream.get_final_response().output_text == handle.script
    assert client.responses.create(**body).output_text == handle.script


def test_max_output_tokens_ends_it_incomplete():
    fake = FakeHandle()
    with BackgroundServer(create_app(fake)) as srv:
        events = sse_events(srv.url, {"input": "hello", "max_output_tokens": 4})
        out = sdk(srv.url).responses.create(model="fake-model", input="hello", max_output_tokens=4)
    assert events[-1]["type"] == "response.incomplete" and events[-2]["item"]["status"] == "incomplete"
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text == expected_text(ByteTokenizer().apply_chat_template([{"role": "user", "content": "hello"}]), 4)
    assert out.usage.output_tokens == 4


def test_input_items_are_the_chat_conversation(server, handle):
    """Message items (text parts, an earlier reply's output_text), function calls and their outputs, and a
    reasoning item (dropped) give the prompt the chat route gives the same conversation."""
    handle.script = "ok"
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
             {"role": "user", "content": "weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    chat = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert httpx.post(server.url + "/v1/responses", json={"input": items}).status_code == 200
    via_responses = handle.submitted[-1].prompt_token_ids.tolist()
    assert httpx.post(server.url + "/v1/chat/completions", json={"messages": chat}).status_code == 200
    assert via_responses == handle.submitted[-1].prompt_token_ids.tolist()


def test_a_messages_text_parts_join_as_the_chat_routes_do(server, handle):
    """Several text parts: one text, joined by newlines (vLLM's rendering of a chat message's parts)."""
    handle.script = "ok"
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "World"}]
    body = {"input": [{"role": "user", "content": parts}]}
    assert httpx.post(server.url + "/v1/responses", json=body).status_code == 200
    template = ByteTokenizer().apply_chat_template([{"role": "user", "content": "Hello\nWorld"}])
    assert handle.submitted[-1].prompt_token_ids.tolist() == ByteTokenizer().encode(template)


@pytest.mark.parametrize("body,status,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": []}, 400, "input"),
    ({"input": 5}, 422, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     400, "text.format.schema"),
    ({"input": "hi", "store": "yes"}, 422, "store"),
    ({"input": "hi", "top_logprobs": 21}, 400, "top_logprobs"),
])
def test_refusals_name_the_responses_field(server, body, status, param):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_logprobs_of_the_output_text():
    fake = FakeHandle()
    with BackgroundServer(create_app(fake)) as srv:
        out = httpx.post(srv.url + "/v1/responses", json={"input": "abc", "max_output_tokens": 3, "top_logprobs": 2,
                                                          "include": ["message.output_text.logprobs"]}).json()
        events = sse_events(srv.url, {"input": "abc", "max_output_tokens": 3, "top_logprobs": 2})
    Response.model_validate(out)
    part = out["output"][0]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == list(part["text"])
    assert all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    assert [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]] == part["logprobs"]


# -- the real engine: function calls and json_schema output ------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "Forecast",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def live():
    from tests.tiny_engine import tiny_handle
    engine = tiny_handle(max_model_len=512, num_kv_blocks=128)
    with BackgroundServer(create_app(engine, served_model_name="qwen3")) as srv:
        yield srv
    engine.shutdown()


def test_function_calls_streamed_whole_and_fed_back(live):
    client = sdk(live.url)
    kwargs = dict(model="qwen3", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, temperature=0, max_output_tokens=64)
    out = client.responses.create(**kwargs)
    [call] = [item for item in out.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    Response.model_validate(out.model_dump())
    with client.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    [again] = [item for item in final.output if item.type == "function_call"]
    assert (again.name, again.arguments) == (call.name, call.arguments)
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    reply = client.responses.create(model="qwen3", input=items, tools=[WEATHER], max_output_tokens=4)
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    ids = httpx.post(live.url + "/v1/chat/completions", json={"messages": chat, "tools": chat_tools,
                                                              "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert reply.usage.input_tokens == ids
    rendered = httpx.post(live.url + "/detokenize", json={"tokens": httpx.post(
        live.url + "/tokenize", json={"messages": chat}).json()["tokens"]}).json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered and '"city"' in rendered


def test_json_schema_output(live):
    client = sdk(live.url)
    schema = WEATHER["parameters"]
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    out = client.responses.create(model="qwen3", input="A city", text=fmt, temperature=1.0, max_output_tokens=40)
    jsonschema.validate(json.loads(out.output_text), schema)
    assert out.text.format.type == "json_schema" and out.text.format.name == "city"
    with client.responses.stream(model="qwen3", input="A city", text=fmt, max_output_tokens=40) as stream:
        jsonschema.validate(json.loads(stream.get_final_response().output_text), schema)
