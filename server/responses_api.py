"""The OpenAI Responses API, POST /v1/responses, the request side: a Responses body becomes a chat request
(its input items the messages, `instructions` a system message first, its flat function tools and
`tool_choice` the chat forms, `text.format` the response_format, `max_output_tokens` the token limit) and
is checked as one, each refusal naming the Responses field. server/responses_stream.py builds the reply.

Stateless: nothing is stored (a response says `store: false`), so what needs a stored response or
conversation (`previous_response_id`, `conversation`, `background`, `prompt`, item references) is a 400
saying so; send the whole conversation as input instead (a reply's output items, fed back as input,
are messages and function calls again; reasoning items are dropped, as chat templates drop past thinking).
"""
from __future__ import annotations

from server.errors import APIError, invalid, wrong_type
from server.fields import Fields
from server.protocol import MAX_LOGPROBS, ModelInfo, ParsedRequest, parse_chat
from server.tools import NAME

STATELESS = "this server keeps no responses (store is false): send the whole conversation as 'input'"
REFUSED = {"previous_response_id": (None,), "conversation": (None,), "background": (None, False),
           "prompt": (None,), "truncation": (None, "disabled")}
PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "top_k", "min_p", "seed",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "logit_bias",
          "min_tokens", "ignore_eos", "skip_special_tokens")
RENAMED = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),       # chat field -> Responses
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"))
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def parse_responses(body: dict, model: ModelInfo) -> ParsedRequest:
    """POST /v1/responses: the body as a chat request, and what its response object repeats."""
    f = Fields(body)
    for key, harmless in REFUSED.items():
        if body.get(key) not in harmless:
            raise invalid(f"'{key}' is not supported: {STATELESS}" if key != "truncation" else
                          "'truncation' must be 'disabled': an input longer than the context is refused", key)
    f.boolean("store", False)
    metadata = f.raw("metadata", {})
    if not isinstance(metadata, dict):
        raise wrong_type("'metadata' must be an object", "metadata")
    chat = {key: body[key] for key in PASSED if body.get(key) is not None}
    chat["messages"] = _messages(body.get("input"), f.string("instructions"))
    fmt = _text_format(body.get("text"))
    chat.update(_output_fields(body, f, fmt))
    try:
        parsed = parse_chat(chat, model)
    except APIError as e:
        raise _renamed(e) from None
    if parsed.constraint is not None:           # a schema that does not compile is refused naming it
        parsed.constraint.field = _renamed_param(parsed.constraint.field)
    parsed.request_fields = {
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata, "parallel_tool_calls": f.boolean("parallel_tool_calls", True),
        "temperature": f.number("temperature", 1.0), "top_p": f.number("top_p", 1.0),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "text": {"format": fmt or {"type": "text"}}, "reasoning": body.get("reasoning"), "user": body.get("user"),
        "top_logprobs": body.get("top_logprobs"),
    }
    return parsed


def _output_fields(body: dict, f: Fields, fmt: dict | None) -> dict:
    """The chat fields of what shapes the output: token limit, tools, format, logprobs, template variables."""
    chat: dict = {}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if fmt is not None and fmt["type"] != "json_schema":
        chat["response_format"] = {"type": fmt["type"]}
    elif fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt["name"], "schema": fmt["schema"], "strict": fmt.get("strict")}}
    top = f.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    include = f.raw("include", [])
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise wrong_type("'include' must be a list of strings", "include")
    if top is not None or LOGPROBS_INCLUDE in include:
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    kwargs, effort = body.get("chat_template_kwargs"), _reasoning_effort(body.get("reasoning"))
    if effort is not None and (kwargs is None or isinstance(kwargs, dict)):
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}     # a template variable, as vLLM passes it
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    return chat


def _messages(items, instructions: str | None) -> list[dict]:
    """Chat messages of `instructions` and `input` (a string: one user message; or a list of items)."""
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if items is None:
        return messages
    if not isinstance(items, list):
        raise wrong_type("'input' must be a string or a list of input items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(f"'{where}' must be an object (an input item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise invalid(f"'{where}.type' {kind!r} is not supported: input items are messages, function_call, "
                          "function_call_output and reasoning" + ("; " + STATELESS if kind == "item_reference" else ""),
                          f"{where}.type")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise invalid(f"'{where}.role' must be user, system, developer or assistant, got {role!r}", f"{where}.role")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _add_call(messages: list[dict], item: dict, where: str) -> None:
    """A function_call item: a tool call of the assistant message before it (or of a new one)."""
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise wrong_type(f"'{where}.arguments' must be a string (the arguments' JSON)", f"{where}.arguments")
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise wrong_type(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return item[key]


def _text(content, where: str) -> str:
    """A message's (or a function output's) text: a string or a list of text parts, joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise invalid(f"'{where}[{j}]' must be a text part ({', '.join(TEXT_PARTS)}); only text input is "
                          "supported", f"{where}[{j}]")
        texts.append(text)
    return "\n".join(texts)                 # as the chat route joins a message's text parts


def _tools(tools) -> list:
    """Responses' flat function tools ({"type": "function", "name", "parameters", ...}) in the chat form."""
    if not isinstance(tools, list):
        raise wrong_type("'tools' must be a list of tool objects", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"'tools[{i}]' must be a function tool {{\"type\": \"function\", \"name\", "
                          "\"parameters\"}: this server runs no hosted tools", f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                  "tool_choice")


def _text_format(text) -> dict | None:
    """`text.format`, checked (None: plain text; a json_schema format named "response" where unnamed)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise wrong_type("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("'text.format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                      "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    f = Fields(fmt)
    name, strict = f.string("name"), fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise wrong_type("'text.format.strict' must be a boolean", "text.format.strict")
    if not isinstance(fmt.get("schema"), dict):
        raise wrong_type("'text.format.schema' must be a JSON schema (an object)", "text.format.schema")
    return {**fmt, "name": name or "response"}


def _reasoning_effort(reasoning) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise wrong_type("'reasoning' must be an object", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise wrong_type("'reasoning.effort' must be a string", "reasoning.effort")
    return effort


def _renamed(e: APIError) -> APIError:
    """A refusal of the chat request, naming the Responses field it came from."""
    message = e.message
    for chat_name, name in RENAMED:
        message = message.replace(f"'{chat_name}", f"'{name}")
    return APIError(e.status, message, _renamed_param(e.param), e.code)


def _renamed_param(param: str | None) -> str | None:
    for chat_name, name in RENAMED:
        if param is not None and (param == chat_name or param.startswith((chat_name + "[", chat_name + "."))):
            return name if chat_name == "messages" else name + param[len(chat_name):]
    return param


def request_schema(chat: dict) -> dict:
    """The body's JSON schema for /openapi.json (what the checks above enforce; `chat`: the chat body's
    schema, whose sampling fields the two share)."""
    null = {"type": "null"}
    string = {"type": "string"}
    part = {"type": "object", "required": ["type"], "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": string}}
    text = {"anyOf": [string, {"type": "array", "items": part}]}
    item = {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": text}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"const": "function_call"}, "call_id": string, "name": string, "arguments": string}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"}, "call_id": string, "output": text}},
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}}]}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "pattern": NAME.pattern},
        "parameters": {"anyOf": [{"type": "object"}, null]}}}
    fmt = {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "schema"], "properties": {
            "type": {"const": "json_schema"}, "name": {"anyOf": [string, null]}, "schema": {"type": "object"},
            "strict": {"anyOf": [{"type": "boolean"}, null]}}}, null]}
    choice = {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object", "required": ["type", "name"],
              "properties": {"type": {"const": "function"}, "name": string}}, null]}
    properties = {key: chat["properties"][key] for key in PASSED}
    properties.update({
        "input": {"anyOf": [string, {"type": "array", "items": item}, null]},
        "instructions": {"anyOf": [string, null]},
        "max_output_tokens": chat["properties"]["max_completion_tokens"],
        "tools": {"anyOf": [{"type": "array", "items": tool}, null]}, "tool_choice": choice,
        "text": {"anyOf": [{"type": "object", "properties": {"format": fmt}}, null]},
        "top_logprobs": chat["properties"]["top_logprobs"],
        "include": {"anyOf": [{"type": "array", "items": string}, null]},
        "store": {"anyOf": [{"type": "boolean"}, null]}, "metadata": {"anyOf": [{"type": "object"}, null]},
        "reasoning": {"anyOf": [{"type": "object", "properties": {"effort": {"anyOf": [string, null]}}}, null]},
        "chat_template_kwargs": {"anyOf": [{"type": "object"}, null]},
        "previous_response_id": null, "conversation": null, "prompt": null,
        "background": {"anyOf": [{"const": False}, null]}, "truncation": {"anyOf": [{"const": "disabled"}, null]},
    })
    return {"type": "object", "properties": properties}


RESPONSE_SCHEMA = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
                   "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                  "created_at": {"type": "integer"}, "status": {"type": "string"},
                                  "model": {"type": "string"}, "output": {"type": "array", "items": {"type": "object"}}}}
