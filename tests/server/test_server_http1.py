"""HTTP/1 clients below the OpenAI ones, over raw sockets: an HTTP/1.0 client gets a streamed answer
un-chunked (it knows no chunked coding), its end marked by the connection's close, and its answer even
where it half-closes its connection after sending the request; HTTP/1.1 clients are served as before
(chunked streams, the connection reused, a client whose input ends taken as gone)."""
from __future__ import annotations

import json
import socket
import time

import pytest

from server.app import create_app
from server.background import BackgroundServer
from tests.tiny_engine import tiny_handle

BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def handle():
    h = tiny_handle(max_model_len=64, num_kv_blocks=64)
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def server(handle):
    with BackgroundServer(create_app(handle, served_model_name="tiny")) as srv:
        yield srv


def request(version: str, body: dict, headers: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{headers}\r\n").encode() + data


def exchange(server, data: bytes, half_close: bool = False, timeout: float = 60.0) -> bytes:
    """Send data, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def split(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}, body


def sse_text(body: bytes) -> str:
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1]), body[:300]
    return "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1])


def whole_text(server) -> str:
    status, headers, body = split(exchange(server, request("1.1", BODY, "Connection: close\r\n")))
    return json.loads(body)["choices"][0]["text"]


@pytest.mark.parametrize("half_close", [False, True])
def test_http10_stream_is_not_chunked_and_ends_with_the_connection(server, half_close):
    status, headers, body = split(exchange(server, request("1.0", {**BODY, "stream": True}), half_close))
    assert status.endswith("200 OK") and headers["content-type"] == "text/event-stream"
    assert "transfer-encoding" not in headers and "content-length" not in headers and headers["connection"] == "close"
    assert sse_text(body) == whole_text(server)


def test_http10_whole_answer_has_its_length(server):
    status, headers, body = split(exchange(server, request("1.0", BODY)))
    assert status.endswith("200 OK") and int(headers["content-length"]) == len(body)
    assert json.loads(body)["choices"][0]["text"] == whole_text(server)


def test_a_half_closed_http10_request_gets_its_answer(server):
    """The client shuts down its sending side once the request is out: the answer is still computed and sent
    (the streamed form: test_http10_stream_is_not_chunked_and_ends_with_the_connection[True])."""
    status, headers, body = split(exchange(server, request("1.0", BODY), half_close=True))
    assert status.endswith("200 OK") and headers["connection"] == "close"
    assert json.loads(body)["choices"][0]["text"] == whole_text(server)


def test_an_http11_client_whose_input_ends_has_gone(server, handle):
    """HTTP/1.1: the end of the client's input while its request runs means it has gone (as a client that
    timed out): the request is aborted at once and its KV freed, not computed to its end."""
    long = {**BODY, "max_tokens": 60}
    before, start = handle.stats().generation_tokens_total, time.monotonic()
    assert exchange(server, request("1.1", long), half_close=True) == b""
    while handle.stats().num_requests or handle.stats().kv_blocks_used:
        assert time.monotonic() - start < 10
        time.sleep(0.02)
    assert handle.stats().generation_tokens_total - before < long["max_tokens"]


def test_keep_alive_is_reused_and_closed_when_the_client_input_ends(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        texts = []
        for _ in range(2):                                  # two answers over one connection
            s.sendall(request("1.1", BODY))
            raw = b""
            while b"\r\n\r\n" not in raw or len(split(raw)[2]) < int(split(raw)[1]["content-length"]):
                raw += s.recv(65536)
            status, headers, body = split(raw)
            assert headers["connection"] == "keep-alive"
            texts.append(json.loads(body)["choices"][0]["text"])
        assert texts[0] == texts[1]
        s.shutdown(socket.SHUT_WR)                          # idle, and no more requests: the server closes
        start = time.monotonic()
        assert s.recv(65536) == b"" and time.monotonic() - start < 5
