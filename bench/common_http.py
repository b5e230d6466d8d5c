"""A small HTTP/1.1 client on asyncio streams, for streamed responses at hundreds of concurrent streams.

The benchmark's own cost per streamed chunk must stay far below the server's inter-token latency;
a general client (httpx: h11 + anyio + a pool that scans every connection per event) spends ~50-100 us
per chunk in Python. This one reads whatever bytes have arrived and decodes every complete chunk of
the chunked transfer encoding in one go (what aiohttp's `iter_any()` gives vLLM's client), and keeps
idle connections for reuse (keep-alive), retrying once on a fresh connection when a reused one turns
out to be closed. Plain http and https.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

READ_SIZE = 1 << 16


class ChunkedDecoder:
    """Incremental decoder of the chunked transfer encoding: feed raw bytes, get the payload so far."""

    def __init__(self) -> None:
        self._buffer = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out = []
        while not self.done:
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                break
            size = int(self._buffer[:line_end].split(b";")[0], 16)
            if size == 0:  # last chunk, then optional trailers, then an empty line
                end = self._buffer.find(b"\r\n\r\n", line_end)
                if end < 0:
                    break
                self.done, self._buffer = True, self._buffer[end + 4:]
                break
            start, stop = line_end + 2, line_end + 2 + size
            if len(self._buffer) < stop + 2:
                break
            out.append(self._buffer[start:stop])
            self._buffer = self._buffer[stop + 2:]
        return b"".join(out)


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()


class Response:
    def __init__(self, status: int, headers: dict[str, str], conn: _Connection) -> None:
        self.status, self.headers, self._conn = status, headers, conn
        self.complete = False  # the whole body was read: the connection can be reused

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunk framing removed)."""
        reader = self._conn.reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            decoder = ChunkedDecoder()
            while not decoder.done:
                data = await reader.read(READ_SIZE)
                if not data:
                    raise ConnectionError("the server closed the connection inside a chunked body")
                payload = decoder.feed(data)
                if payload:
                    yield payload
        elif "content-length" in self.headers:
            length = int(self.headers["content-length"])
            if length:
                yield await reader.readexactly(length)
        else:  # delimited by the end of the connection
            while data := await reader.read(READ_SIZE):
                yield data
            self.headers["connection"] = "close"
        self.complete = True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.iter_raw()])


class HttpClient:
    """POST/GET against one server (scheme://host:port), with a pool of idle keep-alive connections."""

    def __init__(self, base_url: str, tls: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URL must be http(s)://host[:port], got {base_url!r}")
        self.host = parts.hostname
        self.tls = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.tls, limit=READ_SIZE * 4)
        return _Connection(reader, writer)

    def _request_bytes(self, method: str, path: str, body: bytes | None, headers: dict | None) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Accept: */*", "Connection: keep-alive"]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")

    async def _send(self, request: bytes) -> tuple[_Connection, bytes]:
        """Write the request and read up to the end of the response head; a reused connection that
        the server has closed meanwhile is replaced once."""
        for attempt in range(2):
            reused = bool(self._idle) and attempt == 0
            conn = self._idle.pop() if reused else await self._connect()
            try:
                conn.writer.write(request)
                await conn.writer.drain()
                return conn, await conn.reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError):
                conn.close()
                if not reused:
                    raise
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def request(self, method: str, path: str, payload: dict | None = None,
                      headers: dict | None = None) -> AsyncIterator[Response]:
        body = None if payload is None else json.dumps(payload).encode()
        conn, head = await self._send(self._request_bytes(method, path, body, headers))
        status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
        fields = dict(line.split(":", 1) for line in header_lines if ":" in line)
        response = Response(int(status_line.split()[1]),
                            {k.strip().lower(): v.strip() for k, v in fields.items()}, conn)
        try:
            yield response
        finally:
            if response.complete and response.headers.get("connection", "").lower() != "close":
                self._idle.append(conn)
            else:
                conn.close()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def __aenter__(self) -> "HttpClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
