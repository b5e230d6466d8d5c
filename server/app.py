"""The Sanic app: OpenAI-compatible routes over an EngineHandle.

`create_app(handle, ...)` builds it; the handle is anything with the EngineHandle surface
(tokenizer, model_name, max_model_len, submit, abort, stats). Streaming is SSE
(`data: {...}` ... `data: [DONE]`); a client that goes away mid-request cancels its handler task,
and the handler's `finally` aborts the engine requests, freeing their KV blocks.
"""
from __future__ import annotations

import hmac
import itertools
import json
import logging
import time
import uuid

from sanic import Sanic, response

from engine.events import Error, Rejected
from server import __version__
from server.engine_call import EngineCall, engine_failure
from server.errors import APIError, error_response, wrong_type
from server.lora_routes import add_lora_routes, lora_cards
from server.metrics import ServerMetrics
from server.protocol import (ModelInfo, check_token_ids, encode_text, parse_chat, parse_completion,
                             parse_json, parse_messages, render_chat)
from server.responses import ResponseBuilder
from server.structured import check_grammar

log = logging.getLogger("openinfer.server")
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_app_ids = itertools.count()


def create_app(handle, *, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_n: int | None = None) -> Sanic:
    """max_n defaults to what the engine accepts (EngineHandle.max_n)."""
    app = Sanic(f"openinfer_{next(_app_ids)}")
    app.config.REQUEST_MAX_SIZE = max_body_bytes
    app.config.KEEP_ALIVE_TIMEOUT = 30
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.REQUEST_TIMEOUT = 600
    app.config.NOISY_EXCEPTIONS = False
    app.config.TOUCHUP = False          # several apps may start in one process (tests, embedding)
    tokenizer = handle.tokenizer
    app.ctx.handle = handle
    app.ctx.api_key = api_key
    app.ctx.metrics = ServerMetrics()
    app.ctx.model = ModelInfo(name=served_model_name or handle.model_name, max_model_len=handle.max_model_len,
                              tokenizer=tokenizer, vocab_size=_vocab_size(handle),
                              max_n=max_n or _engine_max_n(handle), adapters=getattr(handle, "lora_adapters", {}))
    app.ctx.created = int(time.time())
    app.error_handler.add(Exception, lambda request, exc: error_response(exc))
    app.on_request(_check_api_key)
    _add_routes(app)
    add_lora_routes(app)
    return app


def _engine_max_n(handle) -> int:
    """The n the engine admits (EngineHandle.max_n: max_n capped by max_num_seqs); 16 for a stand-in."""
    return getattr(handle, "max_n", 16)


def _vocab_size(handle) -> int | None:
    for owner in (handle, handle.tokenizer):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


async def _check_api_key(request):
    key = request.app.ctx.api_key
    if not key or not request.path.startswith("/v1"):
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    return None


def _add_routes(app: Sanic) -> None:
    @app.post("/v1/completions")
    async def completions(request):
        return await _generate(request, parse_completion, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request):
        return await _generate(request, parse_chat, "chatcmpl")

    @app.get("/v1/models")
    async def models(request):
        return response.json({"object": "list", "data": [_model_card(request.app)] + lora_cards(request.app)})

    @app.get("/v1/models/<model_id:path>")
    async def model(request, model_id: str):
        card = _model_card(request.app)
        adapter = next((c for c in lora_cards(request.app) if c["id"] == model_id), None)
        if model_id != card["id"] and adapter is None:
            raise APIError(404, f"model '{model_id}' does not exist; this server serves '{card['id']}'",
                           "model", "model_not_found")
        return response.json(adapter or card)

    @app.get("/health")
    async def health(request):
        healthy = getattr(request.app.ctx.handle, "is_healthy", None)
        if callable(healthy) and not healthy():
            raise APIError(503, "engine is not running")
        return response.json({"status": "ok"})

    @app.get("/version")
    async def version(request):
        return response.json({"version": __version__})

    @app.get("/metrics")
    async def metrics(request):
        stats = request.app.ctx.handle.stats()
        return response.text(request.app.ctx.metrics.render(stats),
                             content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request):
        body, model = parse_json(request.body), request.app.ctx.model
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise wrong_type("'add_special_tokens' must be a boolean", "add_special_tokens")
        if "messages" in body:
            ids = render_chat(model.tokenizer, parse_messages(body["messages"]),
                              body.get("add_generation_prompt", True) is not False)
        elif isinstance(body.get("prompt"), str):
            ids = encode_text(model.tokenizer, body["prompt"], add_special)
        else:
            raise wrong_type("'prompt' (a string) or 'messages' is required", "prompt")
        return response.json({"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request):
        body, model = parse_json(request.body), request.app.ctx.model
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise wrong_type("'tokens' must be a list of integer token ids", "tokens")
        check_token_ids(ids, model.vocab_size, "tokens")
        return response.json({"prompt": model.tokenizer.decode(ids)})


def _model_card(app: Sanic) -> dict:
    model = app.ctx.model
    return {"id": model.name, "object": "model", "created": app.ctx.created, "owned_by": "openinfer",
            "root": model.name, "max_model_len": model.max_model_len}


async def _generate(request, parse, id_prefix: str):
    app = request.app
    parsed = parse(parse_json(request.body), app.ctx.model)
    if parsed.constraint is not None:     # a grammar that cannot compile is refused before the engine sees it
        await check_grammar(parsed.constraint.grammar, parsed.constraint.field, app.ctx.model)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    builder = ResponseBuilder(parsed, request_id, parsed.lora_name or app.ctx.model.name, int(time.time()),
                              app.ctx.model.tokenizer)
    call = EngineCall(app.ctx.handle, parsed, request_id, app.ctx.metrics)
    try:
        await call.start()
        if parsed.stream:
            await _stream(request, call, builder)
            return None
        async for prompt_idx, event in call.events():
            if isinstance(event, (Error, Rejected)):
                raise engine_failure(event)
            builder.on_event(prompt_idx, event)
        return response.json(builder.response())
    finally:
        await call.close()
        _log_request(request_id, call)


async def _stream(request, call: EngineCall, builder: ResponseBuilder) -> None:
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async for prompt_idx, event in call.events():
        if isinstance(event, (Error, Rejected)):
            await resp.send(sse(engine_failure(event).body()))
            break
        for chunk in builder.on_event(prompt_idx, event):
            await resp.send(sse(chunk))
    if builder.parsed.include_usage:
        await resp.send(sse(builder.usage_chunk()))
    await resp.send("data: [DONE]\n\n")
    await resp.eof()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _log_request(request_id: str, call: EngineCall) -> None:
    s = call.summary()
    ttft = f"{s['ttft'] * 1000:.1f}ms" if s["ttft"] is not None else "-"
    rate = f"{s['tokens_per_s']:.1f}" if s["tokens_per_s"] is not None else "-"
    log.info("request %s: prompt=%d completion=%d cached=%d ttft=%s tokens/s=%s", request_id,
             s["prompt_tokens"], s["completion_tokens"], s["cached_tokens"], ttft, rate)

