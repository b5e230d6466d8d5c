"""The OpenAPI 3.1 document served at /openapi.json: every route of the running server, its request
body and its answers (an OpenAI error body for every refusal). Bodies list the fields this server reads,
with the ranges the validators enforce (server/protocol.py) for this server's model and ServerLimits; what
one schema cannot say (a prompt plus max_tokens must fit max_model_len) is the validators' alone. It
declares the bearer key only where the server requires one (--api-key), and the LoRA routes only where
they are served (--enable-lora)."""
from __future__ import annotations

from server.protocol import CHAT_ROLES, MAX_LOGPROBS, ModelInfo
from server.responses_api import RESPONSE_SCHEMA, request_schema


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _bounded(kind: str, lo=None, hi=None) -> dict:
    schema = {"type": kind}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return _nullable(schema)


def _int(lo: int | None = None, hi: int | None = None) -> dict:
    return _bounded("integer", lo, hi)


def _num(lo: float | None = None, hi: float | None = None) -> dict:
    return _bounded("number", lo, hi)


_BOOL = _nullable({"type": "boolean"})


def _only_with(flag: str) -> dict:
    """The branch of a body's anyOf where `flag` is true (a field that needs it is then allowed)."""
    return {"required": [flag], "properties": {flag: {"const": True}}}
_STR = _nullable({"type": "string"})
_ANY_OBJECT = {"type": "object"}


def _bodies(model: ModelInfo) -> dict[str, dict]:
    """The request bodies, with this server's vocabulary, context length and ServerLimits."""
    limits = model.limits
    token = {"type": "integer", "minimum": 0}
    if model.vocab_size:
        token["maximum"] = model.vocab_size - 1
    token_ids = {"type": "array", "items": token}
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    sampling = {
        "model": _STR,                  # the served model's name or one of its LoRA adapters' (else a 404)
        "max_tokens": _int(1, model.max_model_len - 1),
        "temperature": _num(0),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _int(-1),
        "min_p": _num(0, 1),
        "seed": _int(-(2 ** 63), 2 ** 64 - 1),
        "presence_penalty": _num(-2, 2),
        "frequency_penalty": _num(-2, 2),
        "repetition_penalty": _num(1e-6, 1e6),
        "logit_bias": _nullable({"type": "object", "maxProperties": limits.max_logit_bias,
                                 "propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "n": _int(1, model.max_n),
        "stop": _nullable({"anyOf": [stop, {"type": "array", "items": stop,
                                            "maxItems": limits.max_stop_strings}]}),
        "stop_token_ids": _nullable({**token_ids, "maxItems": limits.max_stop_token_ids}),
        "min_tokens": _int(0),
        "ignore_eos": _BOOL,
        "skip_special_tokens": _BOOL,
        "stream": _BOOL,
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL,
                                                                        "continuous_usage_stats": _BOOL}}),
        "user": _STR,
        "return_tokens_as_token_ids": _BOOL,
        # structured output (server/structured.py): one constraint per request
        "response_format": _nullable({"anyOf": [   # only json_schema's json_schema is read
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "properties": {
                    "name": _STR, "schema": {"type": ["object", "boolean"]}, "strict": _BOOL}}}}]}),
        "guided_json": _nullable({"anyOf": [_ANY_OBJECT, {"type": "string"}]}),
        "guided_regex": _STR,
        "guided_choice": _nullable({"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}),
        "guided_grammar": _STR,
        "structured_outputs": _nullable(_ANY_OBJECT),
    }
    tool = {"type": "object", "required": ["function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": _STR,
            "parameters": _nullable(_ANY_OBJECT)}}}}
    named_tool = {"type": "object", "required": ["function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    message = {"anyOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": [r for r in CHAT_ROLES if r != "assistant"]}, "content": content}},
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": _nullable(content)}}]}
    messages = {"type": "array", "minItems": 1, "items": message}
    prompt = {"anyOf": [{"type": "string", "minLength": 1},
                        {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
                         "items": {"type": "string", "minLength": 1}},
                        {**token_ids, "minItems": 1},
                        {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
                         "items": {**token_ids, "minItems": 1}}]}
    return {
        "completion": {"type": "object", "required": ["prompt"], "properties": {
            **sampling, "prompt": prompt, "echo": _BOOL, "logprobs": _int(0, MAX_LOGPROBS),
            "prompt_logprobs": _int(0, MAX_LOGPROBS),
            "max_tokens": _int(0, model.max_model_len - 1)},
            "anyOf": [_only_with("echo"), {"properties": {"max_tokens": sampling["max_tokens"]}}]},  # 0: score
        "chat": {"type": "object", "required": ["messages"], "properties": {
            **sampling, "messages": messages, "max_completion_tokens": _int(1, model.max_model_len - 1),
            "logprobs": _BOOL, "top_logprobs": _int(0, MAX_LOGPROBS), "add_generation_prompt": _BOOL,
            "tools": _nullable({"type": "array", "items": tool}), "parallel_tool_calls": _BOOL,
            "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named_tool]}),
            "prompt_logprobs": _int(0, MAX_LOGPROBS), "chat_template_kwargs": _nullable(_ANY_OBJECT),
            "include_reasoning": _BOOL},
            "anyOf": [_only_with("logprobs"), {"properties": {"top_logprobs": {"type": "null"}}}]},
        "tokenize": {"anyOf": [
            {"type": "object", "required": ["prompt"],
             "properties": {"model": sampling["model"], "prompt": {"type": "string"},
                            "add_special_tokens": _BOOL, "return_token_strs": _BOOL}},
            {"type": "object", "required": ["messages"],
             "properties": {"model": sampling["model"], "messages": messages, "add_generation_prompt": _BOOL,
                            "add_special_tokens": _BOOL, "return_token_strs": _BOOL,
                            "tools": _nullable({"type": "array", "items": tool})}}]},
        "detokenize": {"type": "object", "required": ["tokens"],
                       "properties": {"model": sampling["model"], "tokens": token_ids}},
        "token_ids": token_ids,
    }


ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": _STR, "code": _STR}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                        "total_tokens": {"type": "integer"}}}
FINISH_REASON = _nullable({"enum": ["stop", "length", "abort"]})
COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"],
                                           "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                                          "finish_reason": FINISH_REASON,
                                                          "logprobs": _nullable(_ANY_OBJECT)}}}}}
CHAT_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"],
                                           "properties": {"index": {"type": "integer"},
                                                          "message": {"type": "object", "required": ["role"]},
                                                          "finish_reason": FINISH_REASON,
                                                          "logprobs": _nullable(_ANY_OBJECT)}}}}}
MODEL = {"type": "object", "required": ["id", "object", "max_model_len"],
         "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                        "max_model_len": {"type": "integer"}}}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _answers(ok: dict, *errors: int, stream: bool = False) -> dict:
    content = _json(ok)
    if stream:
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {"data": {"type": "string"}}},
                                        "description": "with stream: `data: {chunk}` events, then `data: [DONE]`"}
    answers = {"200": {"description": "OK", "content": content}}
    for status in errors:
        answers[str(status)] = {"description": "an OpenAI error body naming the field", "content": _json(ERROR)}
    return answers


def _post(summary: str, body: dict, ok: dict, stream: bool = False) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": _json(body)},
                     "responses": _answers(ok, 400, 401, 404, 408, 413, 415, 422, 500, 503, stream=stream)}}


def _get(summary: str, ok: dict, *errors: int, open_route: bool = False, content: dict | None = None) -> dict:
    answers = _answers(ok, *errors)
    if content is not None:
        answers["200"]["content"] = content
    op = {"summary": summary, "responses": answers}
    if open_route:
        op["security"] = []
    return {"get": op}


def _without_auth(paths: dict) -> dict:
    """The operations of a server with no API key: no 401 answers, no per-route security."""
    for item in paths.values():
        for method, op in item.items():
            if method != "parameters":
                op["responses"].pop("401", None)
                op.pop("security", None)
    return paths


def _lora_post(summary: str, fields: list[str], flags: tuple[str, ...] = ()) -> dict:
    body = {"type": "object", "required": fields,
            "properties": {**{f: {"type": "string", "minLength": 1} for f in fields},
                           **{f: {"type": "boolean"} for f in flags}}}
    op = _post(summary, body, {})
    op["post"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    op["post"]["responses"]["403"] = {"content": _json(ERROR), "description": (
        "run-time LoRA loading is off (VLLM_ALLOW_RUNTIME_LORA_UPDATING), or lora_path is outside the allowed folders")}
    return op


def _reset_post() -> dict:
    """vLLM's POST /reset_prefix_cache: an optional empty JSON object as the body."""
    op = _post("Evict every unused block of the device prefix cache (to the host KV tier where there is one)",
               {"type": "object", "additionalProperties": False, "properties": {}}, {})
    op["post"]["requestBody"]["required"] = False
    op["post"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return op


def _with_rank_header(op: dict, engines: int) -> dict:
    """A generation route's optional X-data-parallel-rank header (vLLM's): the engine that serves the request."""
    op["post"]["parameters"] = [{"name": "X-data-parallel-rank", "in": "header", "required": False,
                                 "schema": {"type": "integer", "minimum": 0, "maximum": engines - 1},
                                 "description": "the engine (of --data-parallel-size) to serve the request"}]
    return op


def openapi_document(version: str, model: ModelInfo, *, api_key: bool = False, lora: bool = False,
                     engines: int = 1) -> dict:
    """The document of a server for `model`; api_key: it requires the bearer key; lora: it serves adapters;
    engines: its --data-parallel-size."""
    bodies = _bodies(model)
    paths = {
        "/v1/completions": _post("Complete a prompt (or a list of prompts)", bodies["completion"],
                                 COMPLETION, stream=True),
        "/v1/chat/completions": _post("Answer a conversation", bodies["chat"], CHAT_COMPLETION, stream=True),
        "/v1/responses": _post("OpenAI's Responses API, stateless (typed events with stream)",
                               request_schema(bodies["chat"]), RESPONSE_SCHEMA, stream=True),
        "/v1/models": _get("The served model", {"type": "object", "required": ["object", "data"],
                                                "properties": {"data": {"type": "array", "items": MODEL}}},
                           401),
        "/v1/models/{model_id}": {**_get("One model", MODEL, 401, 404), "parameters": [
            {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]},
        "/tokenize": _post("Token ids of a prompt or a conversation", bodies["tokenize"], {
            "type": "object", "required": ["tokens", "count", "max_model_len"],
            "properties": {"tokens": bodies["token_ids"], "count": {"type": "integer"},
                           "max_model_len": {"type": "integer"},
                           "token_strs": {"type": "array", "items": {"type": ["string", "null"]}}}}),
        "/detokenize": _post("Text of token ids", bodies["detokenize"], {
            "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
        "/tokenizer_info": _get("The tokenizer's configuration (vLLM's fields)", {
            "type": "object", "required": ["tokenizer_class"],
            "properties": {"tokenizer_class": {"type": "string"}, "eos_token": _STR, "bos_token": _STR,
                           "chat_template": _STR}}, 401, 404),
        "/health": _get("200 while the engine runs", {"type": "object"}, 503, open_route=True),
        "/version": _get("The server's version", {"type": "object", "required": ["version"]}, open_route=True),
        "/metrics": _get("Prometheus metrics", {}, open_route=True,
                         content={"text/plain": {"schema": {"type": "string"}}}),
        "/openapi.json": _get("This document", {"type": "object"}, open_route=True),
        "/reset_prefix_cache": _reset_post(),
    }
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        _with_rank_header(paths[route], engines)
    if lora:
        paths["/v1/load_lora_adapter"] = _lora_post(
            "Load a LoRA adapter (run-time loading allowed: VLLM_ALLOW_RUNTIME_LORA_UPDATING; lora_path inside an "
            "--allowed-lora-path folder; load_inplace: replace the one loaded under that name)",
            ["lora_name", "lora_path"], ("load_inplace",))
        paths["/v1/unload_lora_adapter"] = _lora_post("Unload a LoRA adapter, once its requests have ended (with "
                                                      "run-time loading allowed)", ["lora_name"])
    doc = {"openapi": "3.1.0",
           "info": {"title": "openinfer", "version": version,
                    "description": f"OpenAI-compatible completions and chat completions of '{model.name}' "
                                   f"(max_model_len {model.max_model_len}), and vLLM's tokenizer routes."},
           "paths": paths if api_key else _without_auth(paths)}
    if api_key:
        doc["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        doc["security"] = [{"bearer": []}]
    return doc
