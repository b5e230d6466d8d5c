"""The HTTP/1 connection: Sanic's, with two client forms it mishandles.

- An HTTP/1.0 client knows no chunked transfer coding (RFC 9112 §6.1: a server must not send it one):
  a streamed answer of unknown length goes as it is, and the connection's close ends it.
- A client that half-closes (shuts down its writing side once its request is sent, as `nc -N` does)
  still reads: the end of its input ends only the connection's keep-alive, not the request being
  answered (asyncio's default closes the transport). TCP tells a half-close from a client gone only when
  the server writes: a client that went away is noticed at its stream's next chunk (its request then
  aborted, its KV freed), or when a whole answer is written.
"""
from __future__ import annotations

from sanic.http import Http, Stage
from sanic.headers import format_http1_response
from sanic.server.protocols.http_protocol import HttpProtocol


class Http1(Http):
    __slots__ = ()

    async def http1_response_header(self, data: bytes, end_stream: bool) -> None:
        res = self.response
        if (end_stream or self.request is None or self.request.version != "1.0" or self.head_only
                or "content-length" in res.headers or getattr(res, "body", None)):
            return await super().http1_response_header(data, end_stream)
        self.keep_alive = False                 # the close is the body's end
        res.headers["connection"] = "close"
        if self.protocol.access_log:
            self.log_response()
        await self._send(format_http1_response(res.status, res.processed_headers) + data)
        self.response_func = self._http10_body
        self.stage = Stage.RESPONSE

    async def _http10_body(self, data: bytes, end_stream: bool) -> None:
        """A streamed body to an HTTP/1.0 client: its bytes as they are."""
        if data:
            await self._send(data)
        if end_stream:
            self.response_func = None
            self.stage = Stage.IDLE


class Http1Protocol(HttpProtocol):
    """Sanic's protocol with Http1, answering a request whose client half-closed its connection."""
    HTTP_CLASS = Http1
    __slots__ = ("input_ended",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.input_ended = False

    def eof_received(self) -> bool:
        """The client sends no more: answer what it sent, then close (True keeps the transport open)."""
        self.input_ended = True
        if self._http is not None:
            self._http.keep_alive = False
        if self._data_received:
            self._data_received.set()
        return True

    async def receive_more(self) -> None:
        if self.input_ended:                    # waiting for bytes that will not come: as a closed client
            self.close()
        await super().receive_more()
