"""Run a Sanic app on its own event loop in a background thread (tests, embedding, `generate`).

`with BackgroundServer(app) as srv: srv.url` — binds 127.0.0.1 on a free port, returns once it is
listening, and on exit stops accepting, closes open connections and joins the thread.
"""
from __future__ import annotations

import asyncio
import socket
import threading


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

    def stop(self, timeout: float = 30.0) -> None:
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


async def serve_until(app, sock: socket.socket, stop: asyncio.Event, on_ready=None,
                      grace_s: float = 5.0) -> None:
    """Serve `app` on `sock` until `stop` is set; then stop accepting, let in-flight requests run for
    up to `grace_s`, close every connection (which aborts what is left) and run the stop listeners."""
    server = await app.create_server(sock=sock, return_asyncio_server=True, access_log=False)
    await server.startup()
    await server.before_start()
    await server.start_serving()
    await server.after_start()
    if on_ready is not None:
        on_ready()
    await stop.wait()
    server.server.close()                      # no new connections
    deadline = asyncio.get_running_loop().time() + grace_s
    while server.connections and asyncio.get_running_loop().time() < deadline:
        for conn in list(server.connections):
            conn.close_if_idle()
        await asyncio.sleep(0.05)
    await server.before_stop()
    for conn in list(server.connections):
        conn.close()
    await server.wait_closed()
    await server.after_stop()
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
