"""How long the server waits for a request to arrive, in total however slowly it trickles in: its headers
and then its body each within the request timeout (ServerLimits.request_timeout), or a 408 with an OpenAI
error body and the connection closed. Sanic's own REQUEST_TIMEOUT counts seconds of silence only, so a
client sending one header byte every few seconds would hold its connection forever (slow loris)."""
from __future__ import annotations

import asyncio

from sanic import Request
from sanic.exceptions import RequestTimeout

from server.http1 import Http1, Http1Protocol


def unread(request) -> bool:
    """Sanic's stand-in for a request whose headers were never read (cut off, malformed): it carries the
    error answer only, so there is nothing to check on it (the 408 stays a 408, not a 401 or a 503)."""
    return request.method == "NONE"


class BoundedRequest(Request):
    """A request whose whole body must arrive within the request timeout."""

    async def receive_body(self):
        timeout = self.app.ctx.limits.request_timeout
        try:
            await asyncio.wait_for(super().receive_body(), timeout)
        except asyncio.TimeoutError:
            # Sanic's HTTP/1 connection would read the rest of the body after the error response, at
            # the client's pace: mark it as done and the connection as closing instead
            self.stream.request_body, self.stream.keep_alive = None, False
            raise RequestTimeout(f"request body not received within {timeout:g} s") from None


class BoundedHttp(Http1):
    """An HTTP/1 connection (server/http1.py's) whose request headers must arrive within the request
    timeout, counted from the request's first byte."""
    __slots__ = ()

    async def http1_request_header(self):
        timeout = self.protocol.app.ctx.limits.request_timeout
        try:
            await asyncio.wait_for(super().http1_request_header(), timeout)
        except asyncio.TimeoutError:
            self.keep_alive = False
            raise RequestTimeout(f"request headers not received within {timeout:g} s") from None


class BoundedHttpProtocol(Http1Protocol):
    HTTP_CLASS = BoundedHttp
    __slots__ = ()
