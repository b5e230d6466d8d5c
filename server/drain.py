"""Graceful shutdown of the generation requests: the server tracks each one it is answering; on
shutdown it refuses new ones (503) and lets the running ones finish for up to drain_timeout seconds,
then aborts the rest in the engine — which ends them as any aborted request ends: a stream gets its
final chunk with finish_reason "abort" and `data: [DONE]`, a non-streaming request its body."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("openinfer.server")
CUT_GRACE_S = 5.0                # how long aborted requests get to send their last chunk


@dataclass
class DrainReport:
    running: int = 0                                   # generation requests when the drain began
    cut: list[str] = field(default_factory=list)       # request ids aborted at the timeout
    seconds: float = 0.0

    @property
    def finished(self) -> int:
        return self.running - len(self.cut)


class InFlight:
    """The generation requests being answered: HTTP request id -> its EngineCall."""

    def __init__(self):
        self.calls: dict = {}
        self.draining = False

    def __len__(self) -> int:
        return len(self.calls)

    async def drain(self, timeout: float, on_tick=None) -> DrainReport:
        """Wait up to `timeout` s for the running requests, then abort the rest and give them
        CUT_GRACE_S to send their ends. on_tick() runs every 50 ms (e.g. to close idle connections)."""
        self.draining = True
        start = time.monotonic()
        report = DrainReport(running=len(self.calls))
        await self._wait(start + timeout, on_tick)
        report.cut = sorted(self.calls)
        for call in list(self.calls.values()):
            await call.abort()
        if report.cut:
            log.warning("shutdown: %d requests still running after the %.0f s drain timeout were ended with "
                        "finish_reason 'abort': %s", len(report.cut), timeout, ", ".join(report.cut))
            await self._wait(time.monotonic() + CUT_GRACE_S, on_tick)
        report.seconds = time.monotonic() - start
        return report

    async def _wait(self, deadline: float, on_tick) -> None:
        while self.calls and time.monotonic() < deadline:
            if on_tick is not None:
                on_tick()
            await asyncio.sleep(0.05)
