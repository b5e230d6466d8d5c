"""Run a Sanic app on its own event loop in a background thread (tests, embedding, `generate`).

`with BackgroundServer(app) as srv: srv.url` — binds 127.0.0.1 on a free port, returns once it is
listening, and on exit shuts down as `openinfer serve` does on SIGTERM (`serve_until`) and joins the
thread.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

from server.deadlines import BoundedHttpProtocol
from server.drain import CUT_GRACE_S

log = logging.getLogger("openinfer.server")
OTHER_REQUESTS_GRACE_S = 1.0      # after the drain: time for requests other than generations to finish


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="openinfer-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Shut down (draining running requests) and wait for it, by default for as long as the
        drain may take."""
        if timeout is None:
            timeout = self.app.ctx.limits.drain_timeout + CUT_GRACE_S + OTHER_REQUESTS_GRACE_S + 10
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:     # surfaced to start() if it happens before ready
            self._error = exc
        finally:
            self._ready.set()
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        await serve_until(self.app, self.sock, self._stop, on_ready=self._ready.set)


async def serve_until(app, sock: socket.socket, stop: asyncio.Event, on_ready=None) -> None:
    """Serve `app` on `sock` until `stop` is set, then shut down gracefully and log what that did:
    drain the generation requests (server/drain.py: up to the app's drain_timeout, then the rest end
    with finish_reason "abort") while answering every new request with a 503, stop listening, give any
    other request a moment, close every connection and run the stop listeners. Connections are served
    by BoundedHttpProtocol: server/http1.py's (HTTP/1.0 and half-closed clients) with server/deadlines.py's
    bound (a request's headers arrive in time or get a 408)."""
    server = await app.create_server(sock=sock, return_asyncio_server=True, access_log=False,
                                     protocol=BoundedHttpProtocol)
    await server.startup()
    await server.before_start()
    await server.start_serving()
    await server.after_start()
    if on_ready is not None:
        on_ready()
    await stop.wait()
    inflight, timeout = app.ctx.inflight, app.ctx.limits.drain_timeout
    log.info("shutdown: draining %d running requests (at most %g s); new requests get a 503", len(inflight),
             timeout)
    report = await inflight.drain(timeout)
    server.server.close()                      # stop listening: the kernel refuses new connections
    deadline = time.monotonic() + OTHER_REQUESTS_GRACE_S
    while server.connections and time.monotonic() < deadline:
        for conn in list(server.connections):
            conn.close_if_idle()
        await asyncio.sleep(0.05)
    busy = len(server.connections)
    await server.before_stop()
    for conn in list(server.connections):
        conn.close()
    await server.wait_closed()
    await server.after_stop()
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    log.info("shutdown: %d of %d running requests finished in the drain, %d ended with finish_reason 'abort' "
             "(%.1f s); %d busy connections closed", report.finished, report.running, len(report.cut),
             report.seconds, busy)
