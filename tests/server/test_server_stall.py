"""One request must not stall the others: /health answers promptly while a huge prompt is tokenized or
refused, and a client that sends its request slowly (slow loris) is cut off after the request timeout."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from engine.tokenizer import Tokenizer, TokenizerBase
from fake_handle import FakeHandle
from server.app import create_app
from server.background import BackgroundServer
from server.limits import ServerLimits
from harness.models import qwen_tokenizer_dir, tokenizer_source

HEALTH_BOUND_S = 0.5      # what a busy 2-core machine answers /health in; the stalls were 2-13 s


def stalled(latencies: list[float], took: float) -> bool:
    """A /health answer waited for the request: longer than HEALTH_BOUND_S and than a quarter of the
    request's time (on an overloaded machine everything is slower; a stall is as long as the request)."""
    return max(latencies) >= max(HEALTH_BOUND_S, took / 4)


class TokenizerOnlyHandle(FakeHandle):
    """Enough of an EngineHandle for requests the server refuses before the engine."""
    model_name = "m"

    def __init__(self, tokenizer, max_model_len: int):
        super().__init__()
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    def submit(self, req):
        raise AssertionError("a refused request reached the engine")

    def abort(self, request_id):
        pass

    def stats(self):
        return None


def health_latencies_during(url: str, request) -> tuple[list[float], httpx.Response]:
    """Poll /health while `request()` runs on another thread; (latencies, its response)."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=request()))
    latencies = []
    with httpx.Client(timeout=30) as client:
        client.get(url + "/health")
        worker.start()
        while worker.is_alive():
            t0 = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    worker.join()
    return latencies, result["r"]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_folder(qwen_tokenizer_dir() or tokenizer_source()[0])


def test_health_stays_fast_while_a_huge_prompt_is_tokenized(tokenizer):
    # a context long enough that 5 MB of text is tokenized (seconds of work), then refused
    handle = TokenizerOnlyHandle(tokenizer, max_model_len=1_000_000)
    text = "hello world, naïve café " * 200_000
    with BackgroundServer(create_app(handle)) as srv:
        def request():
            return httpx.post(srv.url + "/v1/completions", json={"prompt": text}, timeout=120)
        t0 = time.monotonic()
        latencies, r = health_latencies_during(srv.url, request)
        took = time.monotonic() - t0
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "tokens" in r.json()["error"]["message"]          # it was tokenized, then found too long
    assert len(latencies) >= 5, f"the request took only {took:.2f} s: too short to measure a stall"
    assert not stalled(latencies, took), f"/health waited {max(latencies):.2f} s during a {took:.1f} s request"


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(tokenizer):
    handle = TokenizerOnlyHandle(tokenizer, max_model_len=4096)
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    try:
        with BackgroundServer(create_app(handle)) as srv:
            t0 = time.monotonic()
            def request():
                return httpx.post(srv.url + "/v1/completions", json={"prompt": "hi " * 3_500_000}, timeout=60)
            latencies, r = health_latencies_during(srv.url, request)
            took = time.monotonic() - t0
    finally:
        del tokenizer.encode
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "characters" in err["message"]
    assert calls == [] and took < 5
    assert not stalled(latencies or [0.0], took)


def test_a_slow_tokenizer_does_not_hold_up_other_requests():
    class SlowTokenizer(TokenizerBase):
        vocab_size = 300

        def encode(self, text, add_special_tokens=True):
            time.sleep(2.0)                          # a long tokenization, seen from the event loop
            return [1] * 10_000

        def decode(self, ids, skip_special_tokens=False):
            return "x"
    with BackgroundServer(create_app(TokenizerOnlyHandle(SlowTokenizer(), max_model_len=100))) as srv:
        t0 = time.monotonic()
        latencies, r = health_latencies_during(
            srv.url, lambda: httpx.post(srv.url + "/tokenize", json={"prompt": "anything"}, timeout=30))
        took = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["count"] == 10_000
    assert len(latencies) >= 5 and not stalled(latencies, took), (max(latencies), took)


def open_and_send(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


def seconds_until_closed(s: socket.socket, dribble: bytes = b"", every: float = 0.2) -> tuple[float, bytes]:
    """Keep sending `dribble` a byte at a time (if any) until the server answers or closes."""
    t0, got = time.monotonic(), b""
    s.settimeout(every)
    while time.monotonic() - t0 < 10:
        try:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        except socket.timeout:
            if dribble:
                try:
                    s.sendall(dribble[:1])
                except OSError:
                    break
                dribble = dribble[1:] or b"x"
        except OSError:
            break
    return time.monotonic() - t0, got


SLOW = ServerLimits(request_timeout=1.0)
HEADERS_CUT = b"request headers not received within 1 s"
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("case,data,dribble", [
    ("partial headers", HEAD, b""),
    ("headers a byte at a time", HEAD, b"X-Slow: " + b"a" * 1000),      # never silent for a whole second
    ("partial body", HEAD + b"Content-Length: 1000\r\n\r\n{\"prompt\": ", b""),
    ("body a byte at a time", HEAD + b"Content-Length: 1000\r\n\r\n{\"prompt\": \"", b"a" * 1000),
])
def test_a_slow_client_is_cut_off_after_the_request_timeout(tokenizer, case, data, dribble):
    with BackgroundServer(create_app(TokenizerOnlyHandle(tokenizer, 256), limits=SLOW)) as srv:
        s = open_and_send(srv.port, data)
        took, got = seconds_until_closed(s, dribble)
        s.close()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    assert took < SLOW.request_timeout + 2.5, f"{case}: the connection stayed open {took:.1f} s"
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:100]


@pytest.mark.parametrize("api_key,draining", [("k", False), (None, True)])
def test_a_client_cut_off_before_its_headers_gets_a_408(tokenizer, api_key, draining):
    """The answer to headers that never finish is the 408, whatever the request checks would have said of a
    request (an API key: 401; the drain: 503) — there was no request to check."""
    with BackgroundServer(create_app(TokenizerOnlyHandle(tokenizer, 256), api_key=api_key, limits=SLOW)) as srv:
        srv.app.ctx.inflight.draining = draining
        s = open_and_send(srv.port, HEAD)
        took, got = seconds_until_closed(s, b"X-Slow: " + b"a" * 1000)
        s.close()
        srv.app.ctx.inflight.draining = False
    assert got.startswith(b"HTTP/1.1 408") and HEADERS_CUT in got, got[:300]
    assert took < SLOW.request_timeout + 2.5
