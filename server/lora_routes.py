"""LoRA adapters over HTTP, vLLM's interface: `POST /v1/load_lora_adapter {"lora_name", "lora_path",
"load_inplace"}` (load_inplace: replace the adapter loaded under that name; new requests get the new one),
`POST /v1/unload_lora_adapter {"lora_name"}` (both behind the API key, as every /v1 route), and the
adapters' cards in `/v1/models` (`parent`: the base model, `root`: the adapter's folder).

Run-time loading is off unless the server allows it (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, or
--allow-runtime-lora-updating): the two routes then answer 403 naming how to turn it on. A run-time load
reads only inside the allowed folders (--allowed-lora-path, and the resolver folder), judged on real
paths (symlinks resolved, the adapter's two files included): any other path is a 403 that reads the
same whether the path exists or not. `--lora-modules` given at start are trusted as they are.

The handle (engine/engine_calls.py) does the work; a refused adapter (missing file, rank over the limit,
a target the model lacks, a shape mismatch) answers 400 naming the problem, an unknown name 404, and the
server goes on serving. An unload answers once the requests that use the adapter have ended; the name
is refused for new requests from the call on.

With a resolver folder (`--lora-resolver-dir`, vLLM's filesystem resolver: VLLM_LORA_RESOLVER_CACHE_DIR;
run-time loading allowed), a request naming an unknown model loads `<folder>/<model>` as an adapter first,
when that holds an `adapter_config.json` (names of plain path components only: no `..`, no absolute
paths; nothing whose real path leaves the folder).
"""
from __future__ import annotations

import json
import logging
import os
import re

from sanic import response

from engine.engine_calls import EngineCallError
from engine.lora import CONFIG_FILE, WEIGHTS_FILE, LoRAError
from server.body import parse_json
from server.errors import APIError, wrong_type
from server.fields import Fields


log = logging.getLogger("openinfer.server")
_RESOLVABLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
RUNTIME_OFF = ("loading and unloading LoRA adapters at run time is off: start the server with --enable-lora, "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or --allow-runtime-lora-updating) and --allowed-lora-path DIR")


def confined(path: str, roots: tuple[str, ...]) -> str | None:
    """The real path of the adapter folder `path` (`~` expanded, symlinks resolved) when it and its two
    files lie inside one of `roots` (real paths); None otherwise, whether or not anything is there."""
    real = os.path.realpath(os.path.expanduser(path))
    inside = [os.path.realpath(os.path.join(real, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)] + [real]
    if all(any(os.path.commonpath([p, root]) == root for root in roots) for p in inside):
        return real
    return None


def lora_cards(app) -> list[dict]:
    """The /v1/models entries of the adapters served now."""
    model = app.ctx.model
    return [{"id": name, "object": "model", "created": app.ctx.created, "owned_by": "openinfer", "root": path,
             "parent": model.name, "max_model_len": model.max_model_len} for name, path in list(model.adapters.items())]


def _name(body: dict, field: str = "lora_name") -> str:
    value = Fields(body).string(field)
    if not value:
        raise wrong_type(f"'{field}' (a non-empty string) is required", field)
    return value


async def _call(fn, *args) -> None:
    """An engine handle's LoRA op, its errors as API errors."""
    try:
        await fn(*args)
    except LoRAError as e:
        raise APIError(e.status, str(e), "lora_name" if e.status == 404 else None,
                       "lora_adapter_not_found" if e.status == 404 else "invalid_lora_adapter") from None
    except EngineCallError as e:             # the engine process has ended
        raise APIError(e.status, str(e), code="engine_unavailable") from None


def _runtime_updates(app) -> None:
    if not app.ctx.lora_runtime_updates:
        raise APIError(403, RUNTIME_OFF, code="runtime_lora_updating_disabled")


def lora_enabled(handle) -> bool:
    """Whether the engine serves LoRA adapters (--enable-lora): only then are the routes there."""
    return handle.config.enable_lora


def add_lora_routes(app) -> None:
    """The load / unload routes, where the engine serves LoRA adapters (else they do not exist: 404)."""
    if not lora_enabled(app.ctx.handle):
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request):
        _runtime_updates(request.app)
        body = parse_json(request.body)
        name, path = _name(body), _name(body, "lora_path")
        in_place = Fields(body).boolean("load_inplace", False)
        if name == request.app.ctx.model.name:
            raise APIError(400, f"'lora_name' {name!r} is the base model's name", "lora_name")
        real = confined(path, request.app.ctx.lora_roots)
        if real is None:
            raise APIError(403, f"'lora_path' {path!r} is not inside a folder LoRA adapters may be loaded from "
                                f"(--allowed-lora-path, --lora-resolver-dir)", "lora_path", "lora_path_not_allowed")
        await _call(request.app.ctx.handle.load_lora_adapter, name, real, in_place)
        return response.text(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request):
        _runtime_updates(request.app)
        name = _name(parse_json(request.body))
        await _call(request.app.ctx.handle.unload_lora_adapter, name)
        return response.text(f"Success: LoRA adapter '{name}' removed successfully.")


async def resolve_lora(app, raw: bytes) -> bool:
    """Load the adapter an unknown 'model' of the request body `raw` names from the resolver folder (a real
    path); False when there is none to load (no folder, a name that is no plain relative path or whose real
    path leaves the folder, no adapter_config.json there); APIError 400 naming the problem when the folder
    holds a bad adapter."""
    root = app.ctx.lora_resolver_dir
    if root is None:
        return False
    try:
        name = json.loads(raw).get("model")
    except (ValueError, AttributeError):
        return False
    if not isinstance(name, str) or not _RESOLVABLE.fullmatch(name):
        return False
    path = confined(os.path.join(root, name), (root,))
    if path is None or not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return False
    async with app.ctx.lora_resolving:
        if name not in app.ctx.model.adapters:          # a request just before this one may have loaded it
            await _call(app.ctx.handle.load_lora_adapter, name, path, False)
            log.info("LoRA adapter %r resolved from %s", name, path)
    return True
