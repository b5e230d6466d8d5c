"""The routes that describe the server: /v1/models (the base model and its LoRA adapters), /health,
/version, /metrics, /openapi.json; and vLLM's POST /reset_prefix_cache (benchmarks: a prefix hit from the
host tier after the device copy is gone)."""
from __future__ import annotations

from sanic import Sanic, response

from engine.engine_calls import EngineCallError
from server import __version__
from server.body import parse_json
from server.drain import shutting_down
from server.errors import APIError
from server.lora_routes import lora_cards
from server.lora_routes import lora_enabled
from server.openapi import openapi_document


def add_info_routes(app: Sanic) -> None:
    @app.get("/v1/models")
    async def models(request):
        return response.json({"object": "list", "data": [model_card(request.app)] + lora_cards(request.app)})

    @app.get("/v1/models/<model_id:path>")
    async def model(request, model_id: str):
        card = model_card(request.app)
        adapter = next((c for c in lora_cards(request.app) if c["id"] == model_id), None)
        if model_id != card["id"] and adapter is None:
            raise APIError(404, f"model '{model_id}' does not exist; this server serves '{card['id']}'",
                           "model", "model_not_found")
        return response.json(adapter or card)

    @app.get("/health")
    async def health(request):
        if request.app.ctx.inflight.draining:
            raise shutting_down(request)
        if not request.app.ctx.handle.is_healthy():
            raise APIError(503, "engine is not running")
        return response.json({"status": "ok"})

    @app.get("/version")
    async def version(request):
        return response.json({"version": __version__})

    @app.get("/metrics")
    async def metrics(request):
        handle = request.app.ctx.handle
        stats = handle.stats()
        several = request.app.ctx.data_parallel_size > 1       # per engine too (engine/process_replicas.py)
        text = request.app.ctx.metrics.render(stats, handle.replica_stats() if several else None,
                                              handle.dispatched if several else None)
        return response.text(text, content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request):
        fields = parse_json(request.body) if request.body else {}      # an empty object, or no body at all
        if fields:
            raise APIError(400, f"unknown field(s): {', '.join(sorted(fields))}")
        try:
            await request.app.ctx.handle.reset_prefix_cache()
        except EngineCallError as e:             # the engine process has ended
            raise APIError(503, str(e), code="engine_unavailable") from None
        return response.text("Success: prefix cache reset.")

    @app.get("/openapi.json")
    async def openapi(request):
        if request.app.ctx.openapi is None:
            ctx = request.app.ctx
            ctx.openapi = openapi_document(__version__, ctx.model, api_key=bool(ctx.api_key),
                                           lora=lora_enabled(ctx.handle), engines=ctx.data_parallel_size)
        return response.json(request.app.ctx.openapi)


def model_card(app: Sanic) -> dict:
    model = app.ctx.model
    return {"id": model.name, "object": "model", "created": app.ctx.created, "owned_by": "openinfer",
            "root": model.name, "max_model_len": model.max_model_len}
