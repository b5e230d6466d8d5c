"""Graceful shutdown of the generation requests: the server tracks each one it is answering; on
shutdown it answers every new request with a 503 (an OpenAI error body, `Retry-After`, the connection
closed after it; `/health` too, for load balancers) and lets the running ones finish for up to
drain_timeout seconds, then aborts the rest in the engine — which ends them as any aborted request
ends: a stream gets its final chunk with finish_reason "abort" and `data: [DONE]`, a non-streaming
request its body."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from server.errors import APIError

log = logging.getLogger("openinfer.server")
CUT_GRACE_S = 5.0                # how long aborted requests get to send their last chunk
RETRY_AFTER_S = 5                # the drain's 503s: retry in this many seconds (another replica, or this restarted)


@dataclass
class DrainReport:
    running: int = 0                                   # generation requests when the drain began
    cut: list[str] = field(default_factory=list)       # request ids aborted at the timeout
    seconds: float = 0.0

    @property
    def finished(self) -> int:
        return self.running - len(self.cut)


class InFlight:
    """The generation requests being answered: HTTP request id -> its EngineCall, and how many are still
    being read (parsed, tokenized) — accepted before the drain began, they are waited for as well."""

    def __init__(self):
        self.calls: dict = {}
        self.arriving = 0
        self.draining = False
        self.cutting = False            # past the drain timeout: a request that starts now is aborted at once

    def __len__(self) -> int:
        return len(self.calls) + self.arriving

    @contextmanager
    def arrival(self):
        """Around a generation request's parsing; its EngineCall enters `calls` right after."""
        self.arriving += 1
        try:
            yield
        finally:
            self.arriving -= 1

    async def drain(self, timeout: float) -> DrainReport:
        """Wait up to `timeout` s for the running requests, then abort the rest and give them
        CUT_GRACE_S to send their ends."""
        self.draining = True
        start = time.monotonic()
        report = DrainReport(running=len(self))
        await self._wait(start + timeout)
        self.cutting = True
        report.cut = sorted(self.calls)
        for call in list(self.calls.values()):
            await call.abort()
        if report.cut:
            log.warning("shutdown: %d requests still running after the %.0f s drain timeout were ended with "
                        "finish_reason 'abort': %s", len(report.cut), timeout, ", ".join(report.cut))
        if len(self):
            await self._wait(time.monotonic() + CUT_GRACE_S)
        report.seconds = time.monotonic() - start
        return report

    async def _wait(self, deadline: float) -> None:
        while len(self) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def shutting_down(request) -> APIError:
    """The 503 for a request that arrives during the drain; its connection closes after the answer."""
    if request.stream is not None:
        request.stream.keep_alive = False
    return APIError(503, "the server is shutting down", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})
