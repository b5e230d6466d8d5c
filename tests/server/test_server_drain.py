"""Shutdown drains: new requests get a 503 with Retry-After (then the server stops listening), running
requests finish up to the drain timeout, the rest end with a final chunk carrying finish_reason "abort"
and `data: [DONE]` (a non-streaming request: its body), the log names what was cut, and a second SIGTERM
exits at once."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from fake_handle import FakeHandle
from server.app import create_app
from server.background import BackgroundServer
from server.drain import RETRY_AFTER_S
from server.limits import ServerLimits
from harness.models import tiny_model_path
from test_server_cli import OPENINFER, ROOT, free_port, wait_healthy


def read_stream(url: str, body: dict, out: dict, key: str) -> None:
    """POST a streaming request; out[key] = the data payloads received (until the server ends it)."""
    payloads = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
    except httpx.HTTPError as exc:
        payloads.append(f"<{type(exc).__name__}>")
    out[key] = payloads


def ending(payloads: list[str]) -> tuple[str | None, str]:
    """(finish_reason of the last choice chunk, the last payload)."""
    chunks = [json.loads(p) for p in payloads if p.startswith("{")]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return (reasons[-1] if reasons else None), (payloads[-1] if payloads else "")


def test_drain_lets_short_requests_finish_and_ends_the_rest_with_abort(caplog):
    handle = FakeHandle(token_delay=0.05)            # 20 tokens/s: 200 tokens outlast the drain
    srv = BackgroundServer(create_app(handle, limits=ServerLimits(drain_timeout=0.8))).start()
    out: dict = {}
    jobs = [threading.Thread(target=read_stream, args=(srv.url, {"prompt": f"long {i}", "max_tokens": 200,
                                                                  "stream": True}, out, f"long{i}")) for i in range(2)]
    jobs.append(threading.Thread(target=read_stream, args=(srv.url, {"prompt": "short", "max_tokens": 10,
                                                                      "stream": True}, out, "short")))
    jobs.append(threading.Thread(target=lambda: out.update(plain=httpx.post(
        srv.url + "/v1/completions", json={"prompt": "plain", "max_tokens": 200}, timeout=60))))
    for job in jobs:
        job.start()
    deadline = time.monotonic() + 10
    while len(handle.active) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(handle.active) == 4
    caplog.set_level(logging.INFO, logger="openinfer.server")
    t0 = time.monotonic()
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    time.sleep(0.2)
    for method, path in (("GET", "/health"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        late = httpx.request(method, srv.url + path, json={"prompt": "late"} if method == "POST" else None, timeout=2)
        assert late.status_code == 503 and late.headers["retry-after"] == str(RETRY_AFTER_S), (path, late.text)
        assert late.json()["error"]["code"] == "shutting_down" and late.headers["connection"] == "close"
    stopper.join(30)
    with pytest.raises(httpx.ConnectError):            # no longer listening
        httpx.get(srv.url + "/health", timeout=2)
    took = time.monotonic() - t0
    for job in jobs:
        job.join(10)
    assert 0.8 <= took < 0.8 + 3, took
    assert ending(out["short"]) == ("length", "[DONE]")            # finished inside the drain
    for key in ("long0", "long1"):
        reason, last = ending(out[key])
        assert (reason, last) == ("abort", "[DONE]"), out[key][-3:]
        assert 3 < len(out[key]) < 200                             # some tokens, then cut
    plain = out["plain"].json()
    assert out["plain"].status_code == 200 and plain["choices"][0]["finish_reason"] == "abort"
    assert handle.active == set() and len(handle.aborted) == 3
    cut_line = next(r.getMessage() for r in caplog.records if "finish_reason 'abort'" in r.getMessage()
                    and "drain timeout" in r.getMessage())
    assert all(rid in cut_line for rid in handle.aborted)
    summary = next(r.getMessage() for r in caplog.records if "finished in the drain" in r.getMessage())
    assert "1 of 4 running requests finished" in summary and "3 ended with finish_reason 'abort'" in summary


def test_a_request_still_being_read_when_the_drain_begins_is_answered():
    """Accepted before the drain, it is waited for like a running one, however long its tokenization takes
    (the drain used to see no running request and close its connection unanswered)."""
    handle = FakeHandle()
    encode = handle.tokenizer.encode

    def slow_encode(text, add_special_tokens=True):
        time.sleep(2.0)
        return encode(text, add_special_tokens)
    handle.tokenizer.encode = slow_encode
    srv = BackgroundServer(create_app(handle)).start()
    out: dict = {}
    job = threading.Thread(target=lambda: out.update(r=httpx.post(
        srv.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 3}, timeout=30)))
    job.start()
    time.sleep(0.5)
    srv.stop()
    job.join(30)
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["text"] == "wol"


def test_requests_arriving_while_draining_get_a_503():
    with BackgroundServer(create_app(FakeHandle())) as srv:
        srv.app.ctx.inflight.draining = True
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        srv.app.ctx.inflight.draining = False


def serve_tiny(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(OPENINFER + ["serve", "--model", tiny_model_path("qwen3_tied"), "--device", "cpu",
                                         "--port", str(port), "--max-model-len", "512", "--num-kv-blocks", "64",
                                         "--max-num-seqs", "1", *flags],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def start_long_streams(url: str, count: int) -> tuple[list[threading.Thread], dict]:
    """`count` streams of 480 tokens each; with --max-num-seqs 1 they run one after another."""
    out: dict = {}
    body = {"prompt": "Tell a story", "max_tokens": 480, "stream": True, "ignore_eos": True}
    jobs = [threading.Thread(target=read_stream, args=(url, body, out, i)) for i in range(count)]
    for job in jobs:
        job.start()
    deadline = time.monotonic() + 60
    while engine_requests(url) < count:                  # all of them in the engine (1 running, the rest queued)
        assert time.monotonic() < deadline, "the streams did not reach the engine"
        time.sleep(0.05)
    return jobs, out


def engine_requests(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next((x for x in text.splitlines() if x.startswith("openinfer_engine_num_requests ")), "x 0")
    return int(float(line.split()[1]))


def test_sigterm_drains_then_aborts_and_exits_cleanly():
    proc, url = serve_tiny("--drain-timeout", "1")
    jobs, out = start_long_streams(url, 10)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    took = time.monotonic() - t0
    for job in jobs:
        job.join(10)
    log = proc.stderr.read()
    assert proc.returncode == 0, log
    assert 1 <= took < 1 + 8, took
    endings = [ending(out[i]) for i in range(10)]
    assert all(last == "[DONE]" for _, last in endings), endings
    reasons = [reason for reason, _ in endings]
    assert set(reasons) <= {"length", "abort"} and reasons.count("abort") >= 3, reasons
    assert "SIGTERM received" in log and "ended with finish_reason 'abort'" in log
    assert "executor: CpuExecutor" in log and "shutdown: engine stopped" in log


def test_a_second_sigterm_exits_at_once():
    proc, url = serve_tiny("--drain-timeout", "60")
    jobs, _ = start_long_streams(url, 10)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None                       # draining: the streams still run
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, log = proc.communicate(timeout=10)       # a surviving engine process would hold stderr open
    assert time.monotonic() - t0 < 3 and proc.returncode != 0
    assert "second SIGTERM, exiting now" in log
    for job in jobs:
        job.join(10)


@pytest.mark.skipif(sys.platform != "linux", reason="signals as on Linux")
def test_the_drain_timeout_flag_is_checked_at_start():
    run = subprocess.run(OPENINFER + ["serve", "--drain-timeout", "-1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ))
    assert run.returncode == 2 and "drain_timeout" in run.stderr
