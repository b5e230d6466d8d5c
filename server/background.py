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
        server = await self.app.create_server(sock=self.sock, return_asyncio_server=True, access_log=False)
        await server.startup()
        await server.before_start()
        await server.start_serving()
        await server.after_start()
        self._ready.set()
        await self._stop.wait()
        await server.before_stop()
        for conn in list(server.connections):
            conn.close_if_idle() or conn.close()
        server.close()
        await server.wait_closed()
        await server.after_stop()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
