"""The Sanic app: OpenAI-compatible routes over an EngineHandle.

`create_app(handle, ...)` builds it; the handle is an engine handle (engine/engine_calls.py EngineCalls,
what it declares, and tokenizer, model_name, max_model_len, submit, abort, stats). Streaming is SSE
(`data: {...}` ... `data: [DONE]`); a client that goes away mid-request cancels its handler task,
and the handler's `finally` aborts the engine requests, freeing their KV blocks. Parsing and
tokenization run off the event loop (server/offload.py); ServerLimits bound what one request may ask
for and how long the server waits for it to arrive (server/deadlines.py); `app.ctx.inflight` tracks the generation
requests for the shutdown drain (server/drain.py).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid

from sanic import Sanic, response

from engine.events import Error, Rejected, Token
from server.auth import OPEN_PATHS, check_api_key
from server.body import parse_json, require_json
from server.deadlines import BoundedRequest, unread
from server.drain import InFlight, shutting_down
from server.engine_call import EngineCall, engine_failure
from server.errors import APIError, error_response
from server.limits import ServerLimits
from server.lora_routes import add_lora_routes, resolve_lora
from server.metrics import ServerMetrics
from server.offload import in_thread
from server.protocol import ModelInfo, parse_chat, parse_completion
from server.reasoning import check_reasoning_parser
from server.request_trace import RequestTrace
from server.responses import ResponseBuilder
from server.responses_api import parse_responses
from server.responses_stream import ResponsesBuilder
from server.routes_info import add_info_routes
from server.routes_tokenizer import add_tokenizer_routes
from server.structured import check_grammar

log = logging.getLogger("openinfer.server")
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_app_ids = itertools.count()


def create_app(handle, *, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_n: int | None = None,
               limits: ServerLimits | None = None, request_trace: str | None = None,
               lora_resolver_dir: str | None = None, allow_runtime_lora: bool = False,
               allowed_lora_paths: tuple[str, ...] = (), reasoning_parser: str | None = None) -> Sanic:
    """max_n defaults to what the engine accepts (EngineHandle.max_n); request_trace: a file for one timeline
    line per generation request (server/request_trace.py). LoRA at run time (server/lora_routes.py):
    allow_runtime_lora turns on /v1/load_lora_adapter and /v1/unload_lora_adapter, whose loads read only
    inside allowed_lora_paths and lora_resolver_dir, a folder of adapters a request's unknown 'model' is
    looked up in (it needs allow_runtime_lora: ValueError otherwise). reasoning_parser: how chat replies
    split off the model's thinking (server/reasoning.py; an unknown name is a ValueError)."""
    limits = limits or ServerLimits()
    limits.validate()
    check_reasoning_parser(reasoning_parser, handle.tokenizer)
    if lora_resolver_dir and not allow_runtime_lora:
        raise ValueError("a LoRA resolver folder needs run-time LoRA loading allowed")
    app = Sanic(f"openinfer_{next(_app_ids)}", request_class=BoundedRequest)
    app.config.REQUEST_MAX_SIZE = max_body_bytes
    app.config.KEEP_ALIVE_TIMEOUT = 30
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.REQUEST_TIMEOUT = limits.request_timeout      # seconds of silence; deadlines.py: in total
    app.config.NOISY_EXCEPTIONS = False
    app.config.TOUCHUP = False          # several apps may start in one process (tests, embedding)
    tokenizer = handle.tokenizer
    app.ctx.handle = handle
    app.ctx.api_key = api_key
    app.ctx.limits = limits
    app.ctx.inflight = InFlight()
    app.ctx.metrics = ServerMetrics()
    app.ctx.request_trace = RequestTrace(request_trace) if request_trace else None
    app.ctx.model = ModelInfo(name=served_model_name or handle.model_name, max_model_len=handle.max_model_len,
                              tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                              max_n=max_n or handle.max_n, limits=limits,
                              max_token_bytes=tokenizer.max_token_bytes,
                              adapters=handle.lora_adapters, reasoning_parser=reasoning_parser)
    app.ctx.data_parallel_size = handle.data_parallel_size
    app.ctx.created = int(time.time())
    app.ctx.lora_runtime_updates = allow_runtime_lora
    app.ctx.lora_resolver_dir = os.path.realpath(lora_resolver_dir) if lora_resolver_dir else None
    app.ctx.lora_roots = tuple(os.path.realpath(p) for p in (*allowed_lora_paths, lora_resolver_dir) if p)
    app.ctx.lora_resolving = asyncio.Lock()
    app.ctx.openapi = None                  # built on first request
    app.error_handler.add(Exception, lambda request, exc: error_response(exc))
    app.on_request(check_api_key)
    app.on_request(_refuse_while_draining)
    app.on_request(require_json)
    _add_generation_routes(app)
    add_info_routes(app)
    add_tokenizer_routes(app)
    add_lora_routes(app)
    return app


async def _refuse_while_draining(request):
    if request.app.ctx.inflight.draining and request.path not in OPEN_PATHS and not unread(request):
        raise shutting_down(request)


def _add_generation_routes(app: Sanic) -> None:
    @app.post("/v1/completions")
    async def completions(request):
        return await _generate(request, parse_completion, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request):
        return await _generate(request, parse_chat, "chatcmpl")

    @app.post("/v1/responses")
    async def responses(request):
        return await _generate(request, parse_responses, "resp", ResponsesBuilder)


def _parse(parse, raw: bytes, model: ModelInfo):
    return parse(parse_json(raw, model.limits.max_json_depth), model)


async def _parse_request(request, parse):
    """The request parsed and checked: its LoRA adapter loaded (server/lora_routes.py), its grammar accepted."""
    app = request.app
    try:
        parsed = await in_thread(_parse, parse, request.body, app.ctx.model)
    except APIError as e:
        if e.code != "model_not_found" or not await resolve_lora(app, request.body):
            raise
        parsed = await in_thread(_parse, parse, request.body, app.ctx.model)
    if parsed.constraint is not None:     # a grammar the engine cannot enforce is refused before it runs
        await check_grammar(parsed.constraint.grammar, parsed.constraint.field, app.ctx.handle)
    return parsed


def data_parallel_rank(request) -> int | None:
    """vLLM's X-data-parallel-rank header: the engine (of --data-parallel-size) to serve the request; None
    without it; 400 unless an integer in [0, data parallel size)."""
    value = request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    size = request.app.ctx.data_parallel_size
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if not 0 <= rank < size:
        raise APIError(400, f"X-data-parallel-rank {value!r}: must be an integer in [0, {size}) (this server runs "
                            f"{size} engine{'s' if size > 1 else ''})", code="invalid_data_parallel_rank")
    return rank


async def _generate(request, parse, id_prefix: str, builder_type=ResponseBuilder):
    app, http = request.app, time.monotonic()
    rank = data_parallel_rank(request)
    with app.ctx.inflight.arrival():     # a drain that begins now waits for it
        parsed = await _parse_request(request, parse)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    builder = builder_type(parsed, request_id, parsed.lora_name or app.ctx.model.name, int(time.time()),
                           app.ctx.model.tokenizer)
    call = EngineCall(app.ctx.handle, parsed, request_id, app.ctx.metrics, data_parallel_rank=rank)
    app.ctx.inflight.calls[request_id] = call
    try:
        await call.start()
        if app.ctx.inflight.cutting:      # parsed after the drain timeout: it ends at once, with "abort"
            await call.abort()
        if parsed.stream:
            await _stream(request, call, builder)
            return None
        async for prompt_idx, event in call.events():
            if isinstance(event, (Error, Rejected)):
                raise engine_failure(event)
            builder.on_event(prompt_idx, event)
        return response.json(builder.response())
    finally:
        try:
            await call.close()
        finally:
            app.ctx.inflight.calls.pop(request_id, None)
        _log_request(request_id, call)
        if app.ctx.request_trace is not None:
            s = call.summary()
            app.ctx.request_trace.write(request_id, call.moments(http), prompt_tokens=s["prompt_tokens"],
                                        completion_tokens=s["completion_tokens"], stream=parsed.stream)


async def _stream(request, call: EngineCall, builder) -> None:
    """Server-sent events: the builder's chunks (ResponseBuilder, or the Responses API's typed events) as
    they come, then its tail."""
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async for prompt_idx, event in call.events():
        if isinstance(event, (Error, Rejected)):
            await resp.send(builder.sse_error(engine_failure(event)))
            break
        for chunk in builder.on_event(prompt_idx, event):
            await resp.send(builder.sse(chunk))
        if call.first_sent is None and isinstance(event, Token):
            call.first_sent = time.monotonic()
    for tail in builder.sse_tail():
        await resp.send(tail)
    await resp.eof()


def _log_request(request_id: str, call: EngineCall) -> None:
    s = call.summary()
    ttft = f"{s['ttft'] * 1000:.1f}ms" if s["ttft"] is not None else "-"
    rate = f"{s['tokens_per_s']:.1f}" if s["tokens_per_s"] is not None else "-"
    log.info("request %s: prompt=%d completion=%d cached=%d ttft=%s tokens/s=%s", request_id,
             s["prompt_tokens"], s["completion_tokens"], s["cached_tokens"], ttft, rate)

