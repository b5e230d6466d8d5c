"""The API key check (`--api-key` / OPENINFER_API_KEY): every route needs `Authorization: Bearer <key>`
(the /v1 routes, /tokenize, /detokenize and /tokenizer_info as in vLLM) except OPEN_PATHS, which carry
no request content: /health and /version for probes, /metrics for Prometheus scrapers (counts and
latencies only), /openapi.json (the API's description)."""
from __future__ import annotations

import hmac

from server.deadlines import unread
from server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json"})


async def check_api_key(request):
    key = request.app.ctx.api_key
    if not key or request.path in OPEN_PATHS or unread(request):
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(_sent_bytes(token.strip()), key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    return None


def _sent_bytes(header_text: str) -> bytes:
    """A header value's bytes as the client sent them (the HTTP layer decodes headers as UTF-8 with
    surrogateescape, so bytes that are not UTF-8 come back as they were)."""
    return header_text.encode("utf-8", "surrogateescape")
