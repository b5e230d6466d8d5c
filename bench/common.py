"""One streamed request against an OpenAI-compatible server, timed the way `vllm bench serve` times it.

Timestamps are taken on the client with `time.perf_counter()` as each complete SSE event is parsed:
- TTFT: request sent -> first chunk whose choice carries non-empty text (or, with logprobs and
  return_tokens_as_token_ids, a token id),
- ITL: the gaps between consecutive chunks with text (one entry per gap, so a server that packs
  several tokens into one chunk shows fewer, longer gaps — as in vLLM's client),
- latency (end-to-end): request sent -> last chunk with text (the trailing usage chunk carries no token),
- output tokens: `completion_tokens` of the final usage chunk (`stream_options.include_usage`);
  without usage, the number of chunks with text.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import ssl
import time
from dataclasses import dataclass, field

from bench.common_http import HttpClient


@dataclass
class RequestSpec:
    """One prompt to send: text (or token ids), its token count and the output length asked for."""
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0             # the server's usage.prompt_tokens when it sends one
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft: float = 0.0               # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0         # perf_counter() when the request was sent
    generated_text: str = ""
    token_ids: list[int] = field(default_factory=list)   # with logprobs and return_tokens_as_token_ids


class SSEParser:
    """Incremental Server-Sent-Events parser: feed raw bytes, get back complete `data:` payloads."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        payloads = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            data = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:  # comment-only events (":" pings) carry no data
                payloads.append(b"\n".join(data).decode("utf-8"))
        return payloads


def _token_ids(choice: dict) -> list[int]:
    """The ids of a completion chunk's tokens, where its logprobs name them "token_id:<id>"."""
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    return [int(t.rsplit(":", 1)[1]) for t in tokens if isinstance(t, str) and t.startswith("token_id:")]


def _choice_text(choice: dict) -> str:
    if "delta" in choice:  # chat completions
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def build_payload(spec: RequestSpec, model: str, endpoint: str, ignore_eos: bool,
                  extra_body: dict | None = None) -> dict:
    """The JSON body: streaming, usage in the last chunk, and (with ignore_eos) exactly output_len tokens."""
    payload: dict = {"model": model, "max_tokens": spec.output_len, "stream": True,
                     "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
        payload["min_tokens"] = spec.output_len
    payload.update(extra_body or {})
    return payload


def auth_headers(api_key: str | None = None) -> dict:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _read_usage(result: RequestResult, usage: dict) -> None:
    result.output_tokens = usage.get("completion_tokens") or result.output_tokens
    result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = details["cached_tokens"]


async def send_request(client: HttpClient, path: str, payload: dict, prompt_len: int,
                       headers: dict | None = None) -> RequestResult:
    """POST one streaming request and time its chunks. Never raises: failures come back in `error`."""
    result = RequestResult(prompt_len=prompt_len)
    chunks_with_text = 0
    parser = SSEParser()
    start = last = time.perf_counter()
    result.start_time = start
    try:
        async with client.request("POST", path, payload, headers) as response:
            if response.status != 200:
                body = (await response.read()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            async for raw in response.iter_raw():
                for data in parser.feed(raw):
                    if data.strip() == "[DONE]":
                        continue
                    now = time.perf_counter()
                    message = json.loads(data)
                    if message.get("error"):
                        raise RuntimeError(f"error in stream: {message['error']}")
                    if message.get("usage"):
                        _read_usage(result, message["usage"])
                    choice = message["choices"][0] if message.get("choices") else {}
                    ids = _token_ids(choice)
                    result.token_ids += ids
                    text = _choice_text(choice) if choice else ""
                    if not (text or ids):      # (a token whose text is still held back counts where named)
                        continue
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
                    result.generated_text += text
    except Exception as exc:  # a failed request is a data point, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if chunks_with_text == 0:
        result.error = "the stream carried no chunk with text, so TTFT is undefined"
        return result
    result.latency = last - start
    result.output_tokens = result.output_tokens or chunks_with_text
    result.success = True
    return result


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # loading the CA store costs ~25 ms: once per process


def make_client(base_url: str) -> HttpClient:
    """A keep-alive client for one server; connections open as requests need them."""
    return HttpClient(base_url, tls=_tls_context() if base_url.startswith("https") else None)


async def first_model(client: HttpClient, headers: dict | None = None) -> str:
    """The first model id that GET /v1/models lists."""
    try:
        async with client.request("GET", "/v1/models", headers=headers) as response:
            body = await response.read()
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise RuntimeError(f"cannot list the models at {client.host}:{client.port}/v1/models "
                           f"({type(exc).__name__}: {exc}); is the server up?")
    if response.status != 200:
        raise RuntimeError(f"GET /v1/models answered HTTP {response.status}: {body[:300]!r}")
    models = json.loads(body).get("data") or []
    if not models:
        raise RuntimeError("/v1/models lists no model; pass --model")
    return models[0]["id"]
