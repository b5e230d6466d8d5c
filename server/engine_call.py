"""The engine requests behind one HTTP request (one per prompt), merged into one ordered event stream.

`EngineCall` submits, merges, times each request for the metrics, and on `close()` aborts every
request that has not finished yet — which is how a client disconnect frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass

import numpy as np

from engine.events import Error, Finished, Rejected, Scheduled, Token
from engine.request import GenerateRequest
from server.errors import APIError
from server.metrics import ServerMetrics
from server.protocol import ParsedRequest

_DONE = object()


def engine_failure(event: Error | Rejected) -> APIError:
    """The HTTP error for a request the engine refused (400: its checks are about the request, e.g.
    more KV cache than the pool holds) or failed (500)."""
    if isinstance(event, Rejected):
        return APIError(400, f"request rejected by the engine: {event.reason}", code="rejected")
    return APIError(500, f"engine error: {event.message}", code="engine_error")


@dataclass
class RequestTiming:
    prompt_tokens: int
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0
    cached: int = 0
    finished_samples: int = 0
    failed: bool = False
    closed: bool = False


class EngineCall:
    def __init__(self, handle, parsed: ParsedRequest, request_id: str, metrics: ServerMetrics | None = None,
                 data_parallel_rank: int | None = None):
        self.handle = handle
        self.parsed = parsed
        self.metrics = metrics
        self.data_parallel_rank = data_parallel_rank     # the engine a client asked for (X-data-parallel-rank)
        many = len(parsed.prompts) > 1
        self.ids = [f"{request_id}-{i}" if many else request_id for i in range(len(parsed.prompts))]
        self.timing = [RequestTiming(len(p), time.monotonic()) for p in parsed.prompts]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.buffered: list[tuple[int, object]] = []
        self.ended = 0              # request streams whose end marker has been taken off the queue
        self.first_sent: float | None = None    # the first token's response chunk written (streaming)

    async def start(self) -> None:
        """Submit every prompt and wait for each one's first event, so that a rejection or an engine
        error becomes an HTTP status before any response byte is sent."""
        for i, prompt in enumerate(self.parsed.prompts):
            ids = prompt if isinstance(prompt, np.ndarray) else list(prompt)      # token-id prompts: int32 arrays
            req = GenerateRequest(self.ids[i], ids, self.parsed.params, lora_name=self.parsed.lora_name,
                                  data_parallel_rank=self.data_parallel_rank)
            try:
                stream = self.handle.submit(req)
            except Exception as exc:      # e.g. the engine is shutting down
                self.timing[i].failed = True
                raise APIError(503, f"engine unavailable: {exc}", code="engine_unavailable") from None
            self.tasks.append(asyncio.create_task(self._pump(i, stream)))
        seen: set[int] = set()
        while len(seen) < len(self.ids):
            item = await self.queue.get()
            if item[1] is _DONE:
                seen.add(item[0])
                self.ended += 1
                continue
            self.buffered.append(item)
            seen.add(item[0])
            if isinstance(item[1], (Error, Rejected)):
                raise engine_failure(item[1])

    async def events(self):
        """(prompt index, event) in arrival order until every request has ended."""
        for item in self.buffered:
            yield item
        self.buffered = []
        while self.ended < len(self.ids):
            item = await self.queue.get()
            if item[1] is _DONE:
                self.ended += 1
                continue
            yield item

    async def _pump(self, i: int, stream) -> None:
        try:
            async for event in stream:
                self._observe(i, event)
                await self.queue.put((i, event))
        except Exception as exc:  # the engine stream broke: report it as that request's error
            self.timing[i].failed = True
            await self.queue.put((i, Error(self.ids[i], f"{type(exc).__name__}: {exc}")))
        finally:
            self.timing[i].closed = True
            await self.queue.put((i, _DONE))
            try:
                await stream.aclose()           # a RequestStream (engine/handle.py): frees what the request held
            except Exception:
                pass

    def _observe(self, i: int, event) -> None:
        t, now = self.timing[i], time.monotonic()
        if isinstance(event, Scheduled):
            t.cached = event.cached_tokens
            t.scheduled = t.scheduled or now
        elif isinstance(event, Token):
            t.first_token = t.first_token or now
            t.last_token = now
            t.generated += 1
        elif isinstance(event, Finished):
            t.finished_samples += 1
            t.failed = t.failed or event.reason == "abort"
        elif isinstance(event, (Error, Rejected)):
            t.failed = True

    def finished(self, i: int) -> bool:
        t = self.timing[i]
        return t.finished_samples >= self.parsed.params.n or t.failed

    async def abort(self) -> None:
        """Abort every request that has not finished; each ends with Finished(reason="abort")."""
        for i, rid in enumerate(self.ids):
            if not self.finished(i):
                self.timing[i].failed = True
                result = self.handle.abort(rid)
                if inspect.isawaitable(result):
                    await result

    async def close(self) -> None:
        """Abort what has not finished, stop the pumps, record metrics. Safe to call twice."""
        await self.abort()
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.metrics is not None:
            for t in self.timing:
                decode = (t.last_token - t.first_token) if t.first_token and t.last_token else None
                self.metrics.observe_request(
                    ok=not t.failed, prompt_tokens=t.prompt_tokens, generated=t.generated, cached=t.cached,
                    ttft=(t.first_token - t.arrival) if t.first_token else None,
                    e2e=time.monotonic() - t.arrival, decode_time=decode)
        self.tasks, self.metrics = [], None

    def moments(self, http: float) -> dict[str, float | None]:
        """The request's timeline for the request trace (server/request_trace.py): its first prompt's."""
        t = self.timing[0]
        return {"http": http, "parsed": t.arrival, "scheduled": t.scheduled, "first_token": t.first_token,
                "first_sent": self.first_sent, "end": t.last_token}

    def summary(self) -> dict:
        """For the per-request log line."""
        firsts = [t.first_token for t in self.timing if t.first_token]
        end = max((t.last_token for t in self.timing if t.last_token), default=None)
        start = min(t.arrival for t in self.timing)
        generated = sum(t.generated for t in self.timing)
        ttft = (min(firsts) - start) if firsts else None
        decode = (end - min(firsts)) if firsts and end else 0.0
        return {"prompt_tokens": sum(t.prompt_tokens for t in self.timing), "completion_tokens": generated,
                "cached_tokens": sum(t.cached for t in self.timing), "ttft": ttft,
                "tokens_per_s": (generated - 1) / decode if decode > 0 and generated > 1 else None}
