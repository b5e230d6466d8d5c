"""The HTTP/1 connection: Sanic's, with two things an HTTP/1.0 client needs.

- It knows no chunked transfer coding (RFC 9112 §6.1: a server must not send it one): a streamed answer
  of unknown length goes as it is, and the connection's close ends it.
- It may half-close (shut down its sending side once its request is out, as `nc -N` does, the way a
  1.0 client marks its request's end): it still reads, so the end of its input does not end the request
  being answered (asyncio's default closes the transport, and the answer is lost).

An HTTP/1.1 client's end of input still means it has gone (its request aborted, its KV freed at once):
TCP tells a half-close from a client gone only when the server writes, and a whole answer is written
only at its end.
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
                or "content-length" in res.headers or res.body):
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
    """Sanic's protocol with Http1, answering an HTTP/1.0 request whose client half-closed its connection."""
    HTTP_CLASS = Http1
    __slots__ = ("input_ended",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.input_ended = False

    def eof_received(self) -> bool | None:
        """An HTTP/1.0 client sends no more: answer what it sent, then close (True keeps the transport open
        for that). Any other: asyncio's way (None: the transport closes, the request is cancelled)."""
        if self._request_version() != "1.0":
            return None
        self.input_ended = True
        if self._http is not None:
            self._http.keep_alive = False
        if self._data_received:
            self._data_received.set()
        return True

    def _request_version(self) -> str | None:
        """The HTTP version of the request being read or answered (from its request line where it is
        not parsed yet: its bytes may come with the end of input)."""
        request = self._http.request if self._http is not None else None
        if request is not None:
            return request.version
        line = bytes(self.recv_buffer[:self.recv_buffer.find(b"\r\n")]) if self.recv_buffer else b""
        return line.rsplit(b"/", 1)[-1].decode("latin-1") if line.endswith((b"HTTP/1.0", b"HTTP/1.1")) else None

    async def receive_more(self) -> None:
        if self.input_ended:                    # waiting for bytes that will not come: as a closed client
            self.close()
        await super().receive_more()
