"""The server's process tree as an operator and its clients meet it — the real `openinfer serve` (CPU, tiny
model) in a subprocess on 127.0.0.1: kill -9 of either process and a restart on the same port, SIGTERM
to the engine process, and requests arriving during a SIGTERM drain (each is answered with a 503 and
Retry-After, or refused once the server stops listening; none hangs). bench/reliability.py runs the
same at larger sizes for bench/results/reliability.md."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.models import tiny_model_path
from test_server_cli import OPENINFER, ROOT, free_port
from test_server_drain import engine_requests, ending, read_stream, start_long_streams

pytestmark = pytest.mark.slow      # each starts one or two servers: 5-30 s apiece on 2 cores
HANG_S = 10.0          # a request without an answer (or a clean close) this long hangs


@dataclass
class Served:
    """`openinfer serve` over the tiny model, its log in a file."""
    proc: subprocess.Popen
    url: str
    log_path: Path

    @classmethod
    def start(cls, folder: Path, port: int, *flags: str) -> "Served":
        log_path = folder / f"serve-{port}-{time.monotonic_ns()}.log"
        proc = subprocess.Popen(OPENINFER + ["serve", "--model", tiny_model_path("qwen3_tied"), "--device", "cpu",
                                             "--port", str(port), "--max-model-len", "512", "--num-kv-blocks", "64",
                                             *flags],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
        served = cls(proc, f"http://127.0.0.1:{port}", log_path)
        deadline = time.monotonic() + 120
        while not served.healthy():
            assert proc.poll() is None, f"the server exited ({proc.returncode}): {served.log()}"
            assert time.monotonic() < deadline, f"the server did not start: {served.log()}"
            time.sleep(0.2)
        return served

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        pid = self.proc.pid
        kids = [int(k) for t in os.listdir(f"/proc/{pid}/task")
                for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        assert len(kids) == 1, kids
        return kids[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def gone(pid: int, within: float) -> bool:
    """The process has exited (an orphan is reaped by init; a child of ours counts once a zombie)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def wait_for_engine_request(url: str) -> None:
    deadline = time.monotonic() + 30
    while engine_requests(url) < 1:
        assert time.monotonic() < deadline, "the request did not reach the engine"
        time.sleep(0.02)


def signal_the_engine_during(served: Served, sig: signal.Signals, request) -> None:
    """request() on a thread; once it is in the engine, `sig` to the engine process; then wait for the
    server to exit and the request to end (the server is stopped in any case)."""
    client = threading.Thread(target=request)
    try:
        client.start()
        wait_for_engine_request(served.url)
        os.kill(served.engine_pid(), sig)
        served.proc.wait(30)
        client.join(HANG_S)
    finally:
        served.stop()


def test_kill_9_of_the_server_ends_the_engine_process_and_a_restart_binds_the_port(tmp_path):
    port = free_port()
    first = Served.start(tmp_path, port)
    engine = first.engine_pid()
    try:
        first.proc.kill()
        first.proc.wait(10)
        assert gone(engine, within=5), "the engine process outlived the server"
    finally:
        if not gone(engine, within=0):
            os.kill(engine, signal.SIGKILL)
    again = Served.start(tmp_path, port)        # 'Address already in use' while an orphan held the listener
    again.stop()
    assert again.proc.returncode == 0, again.log()


def test_kill_9_of_the_engine_process_fails_its_requests_ends_the_server_and_a_restart_serves(tmp_path):
    port = free_port()
    first = Served.start(tmp_path, port)
    out: dict = {}
    body = {"prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}
    signal_the_engine_during(first, signal.SIGKILL,
                             lambda: out.update(r=httpx.post(first.url + "/v1/completions", json=body, timeout=HANG_S)))
    log = first.log()
    assert first.proc.returncode == 1, log
    assert "the engine process ended (killed by SIGKILL); the server stops (exit code 1)" in log
    r = out["r"]           # failed before its first token (a 500), or a stream ending with the error
    assert "engine error: the engine process ended" in r.text, r.text[-300:]
    assert r.status_code == 500 or (r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"))
    again = Served.start(tmp_path, port)
    r = httpx.post(again.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    again.stop()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_sigterm_to_the_engine_process_drains_the_server_and_exits_cleanly(tmp_path):
    served = Served.start(tmp_path, free_port())
    out: dict = {}
    body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True}
    signal_the_engine_during(served, signal.SIGTERM, lambda: read_stream(served.url, body, out, 0))
    log = served.log()
    assert served.proc.returncode == 0, log
    assert "the engine process received SIGTERM; draining the server" in log
    assert ending(out[0]) == ("length", "[DONE]"), out[0][-3:]                 # it ran to its end


def arrive(url: str, results: list, stop: threading.Event) -> None:
    """New requests, one connection each, until `stop`: (status, Retry-After, error code) or the
    transport error's name."""
    while not stop.is_set():
        for method, path in (("POST", "/v1/completions"), ("GET", "/health")):
            try:
                r = httpx.request(method, url + path, json={"prompt": "late", "max_tokens": 2}, timeout=HANG_S)
                error = r.json().get("error") if r.status_code != 200 else None
                results.append((r.status_code, r.headers.get("retry-after"), error and error["code"]))
            except httpx.HTTPError as exc:
                results.append(type(exc).__name__)
        time.sleep(0.05)


def test_requests_arriving_during_the_sigterm_drain_are_answered_and_none_hangs(tmp_path):
    served = Served.start(tmp_path, free_port(), "--max-num-seqs", "1", "--drain-timeout", "2")
    stop = threading.Event()
    try:
        jobs, out = start_long_streams(served.url, 3)
        idle = socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])))  # connected, never asks
        kept = httpx.Client(base_url=served.url, timeout=HANG_S)
        assert kept.get("/health").status_code == 200                     # a kept-alive connection
        results: list = []
        arrivals = threading.Thread(target=arrive, args=(served.url, results, stop), daemon=True)
        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)                                                   # the drain has begun
        arrivals.start()
        time.sleep(0.3)
        late = kept.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        served.proc.wait(30)
        took = time.monotonic() - t0
        stop.set()
        arrivals.join(2 * HANG_S)
        idle.settimeout(HANG_S)
        try:
            idle_end = idle.recv(100)                                     # closed, not left open
        except ConnectionResetError:
            idle_end = b""
        for job in jobs:
            job.join(HANG_S)
    finally:
        stop.set()
        served.stop()
    assert served.proc.returncode == 0 and 2 <= took < 2 + 8, (took, served.log())
    assert late.status_code == 503 and late.headers["retry-after"] and late.headers["connection"] == "close"
    answered = [r for r in results if isinstance(r, tuple)]
    assert answered and set(answered) == {(503, "5", "shutting_down")}, set(answered)
    assert set(results) - set(answered) <= {"ConnectError"}, results      # refused once not listening
    assert idle_end == b""
    assert all(ending(out[i])[1] == "[DONE]" for i in range(3))
