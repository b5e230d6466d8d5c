"""A stand-in OpenAI-compatible server that streams `max_tokens` fixed tokens, one every --interval-ms:
with it, `bench/serve.py` measures its own overhead (how far the measured ITL and throughput fall from
the ideal at a given number of streams). Run it in its own process, next to the client:

    python -m bench.common_loopback --port 18600 --interval-ms 20 &
    python -m bench.serve --base-url http://127.0.0.1:18600 --input-len 8 --output-len 100 --num-prompts 256
"""
from __future__ import annotations

import argparse
import asyncio
import json

MODEL = "loopback"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(payload: dict | str) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return _chunk(b"data: " + text.encode() + b"\n\n")


async def _stream(body: dict, chat: bool, interval_s: float, writer: asyncio.StreamWriter) -> None:
    n = int(body.get("max_tokens") or 16)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    choice = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
    for _ in range(n):
        await asyncio.sleep(interval_s)
        writer.write(_event({"object": "chunk", "model": MODEL, "choices": [{**choice, "finish_reason": None}]}))
        await writer.drain()
    writer.write(_event({"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": n}}))
    writer.write(_event("[DONE]") + _chunk(b""))
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval_s: float) -> None:
    try:
        while True:  # keep-alive: one request after another on the connection
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            length = next((int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if head[0].startswith("GET /v1/models"):
                data = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(data), data))
                await writer.drain()
            else:
                await _stream(body, "/chat/" in head[0], interval_s, writer)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(port: int, interval_s: float, host: str = "127.0.0.1") -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, interval_s), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=18600)
    p.add_argument("--interval-ms", type=float, default=20.0, help="gap between tokens of one stream")
    args = p.parse_args()
    asyncio.run(serve(args.port, args.interval_ms / 1000.0))


if __name__ == "__main__":
    main()
