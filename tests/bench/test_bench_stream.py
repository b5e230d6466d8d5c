"""The benchmark client's timing against a fake SSE server whose per-chunk delays the test controls."""
import asyncio
import gc
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bench.common import RequestSpec, SSEParser, build_payload, endpoint_path, make_client, send_request
from bench.common_metrics import tpot
from bench.serve import run_benchmark

QWEN_TOKENIZER = "/work/shared/models/qwen-tokenizer/tokenizer.json"


class FakeServer:
    """A tiny HTTP/1.1 server in its own thread. `scripts[prompt]` is the list of chunks to stream for
    that prompt: (delay before the chunk in s, text, tokens in it); usage counts the tokens."""

    def __init__(self):
        self.scripts: dict[str, list[tuple[float, str, int]]] = {}
        self.status = 200
        self.drop_after_response = False  # close silently after each response: a stale keep-alive
        self.connections = 0
        self.arrivals: list[float] = []
        self.in_flight = self.peak_in_flight = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _serve(self, ready):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    def stop(self):
        async def shutdown():
            self.server.close()
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if lines[0].startswith("GET /v1/models"):
                    data = json.dumps({"data": [{"id": "fake-model"}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                    await writer.drain()
                    continue
                await self._stream(body, writer)
                if self.drop_after_response:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _stream(self, body, writer):
        self.arrivals.append(time.perf_counter())
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.status != 200:
                msg = b"boom"
                writer.write(b"HTTP/1.1 %d Error\r\nContent-Length: %d\r\n\r\n%s" % (self.status, len(msg), msg))
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            chat = "messages" in body
            prompt = body["messages"][0]["content"] if chat else body.get("prompt")
            script = self.scripts.get(prompt, self.scripts.get("*"))
            events = []
            for delay, text, _ in script:
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                events.append((delay, {"choices": [{**choice, "finish_reason": None}]}))
            usage = {"prompt_tokens": 7, "completion_tokens": sum(n for *_, n in script),
                     "prompt_tokens_details": {"cached_tokens": 3}}
            events.append((0.0, {"choices": [], "usage": usage}))
            for delay, event in events + [(0.0, "[DONE]")]:
                await asyncio.sleep(delay)
                data = b"data: " + (event if isinstance(event, str) else json.dumps(event)).encode() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        finally:
            await writer.drain()
            self.in_flight -= 1


@pytest.fixture
def server():
    s = FakeServer()
    gc.collect()      # the timed tests: no full collection of the whole suite's heap (0.5 s) inside their window
    yield s
    s.stop()


def _send(server, prompt="p", output_len=4, endpoint="completions"):
    async def go():
        async with make_client(server.url) as client:
            payload = build_payload(RequestSpec(prompt, 7, output_len), "fake-model", endpoint, True)
            return await send_request(client, endpoint_path(endpoint), payload, 7)
    return asyncio.run(go())


# Seconds of slack above an injected delay: sleep overshoot, event-loop wake-up and thread hand-over
# on a loaded 2-core machine (CI has seen 26 ms per sleep). A measured time is never below its injected
# delay (minus clock noise), so every bound is one-sided: an average over gaps gets TOL, a sum over n
# sleeps n * TOL, and the injected delays differ by more than TOL, so a metric from the wrong chunk fails.
TOL = 0.05
EPS = 0.002


def test_ttft_itl_tpot_match_injected_delays(server):
    gaps = [0.08, 0.24, 0.02, 0.14]
    # an empty-text chunk (as a role or held-back chunk) comes first: TTFT waits for the first text
    server.scripts["p"] = [(0.10, "", 0), (0.15, "a", 1)] + [(g, "b", 1) for g in gaps]
    r = _send(server)
    assert r.success, r.error
    assert 0.25 - EPS <= r.ttft <= 0.25 + TOL
    assert len(r.itl) == len(gaps)
    np.testing.assert_allclose(r.itl, gaps, atol=TOL)
    assert 0.25 + sum(gaps) - EPS <= r.latency <= 0.25 + sum(gaps) + len(gaps) * TOL
    assert r.output_tokens == 5 and r.prompt_len == 7 and r.cached_tokens == 3
    assert sum(gaps) / 4 - EPS <= tpot(r) <= sum(gaps) / 4 + TOL
    assert tpot(r) == pytest.approx((r.latency - r.ttft) / 4, rel=1e-12)
    assert r.generated_text == "abbbb"


def test_chat_stream_is_timed_from_its_content_deltas(server):
    # a chat stream opens with a role-only delta (empty content): not the first token
    server.scripts["p"] = [(0.1, "", 0), (0.1, "a", 1), (0.1, "b", 1)]
    r = _send(server, endpoint="chat")
    assert r.success and r.generated_text == "ab" and r.output_tokens == 2
    assert 0.2 - EPS <= r.ttft <= 0.2 + TOL and len(r.itl) == 1


def test_output_tokens_come_from_usage_not_chunk_count(server):
    # two tokens per chunk: 4 chunks, 8 tokens -> 3 ITL gaps but TPOT divides by 7
    server.scripts["p"] = [(0.08, "ab", 2)] + [(0.07, "cd", 2)] * 3
    r = _send(server)
    assert r.success and r.output_tokens == 8 and len(r.itl) == 3
    # TPOT is the decode time over the 7 tokens after the first, whatever the machine's sleep overshoot
    # (it adds to every gap alike, so it cannot tell 7 from 3); the decode time itself is bounded below
    assert tpot(r) == pytest.approx((r.latency - r.ttft) / 7, rel=1e-12)
    assert r.latency - r.ttft >= 0.21 - EPS


def test_failures_are_reported_not_raised(server):
    server.status = 500
    r = _send(server)
    assert not r.success and "HTTP 500" in r.error and "boom" in r.error
    server.status = 200
    server.scripts["p"] = [(0.01, "", 0)]
    r = _send(server)
    assert not r.success and "no chunk with text" in r.error
    r = asyncio.run(_closed_port())
    assert not r.success and r.error


async def _closed_port():
    async with make_client("http://127.0.0.1:9") as client:
        return await send_request(client, "/v1/completions", {}, 1)


def test_connections_are_reused_and_a_closed_one_is_replaced(server):
    server.scripts["*"] = [(0.0, "x", 1)]

    async def three_in_a_row():
        async with make_client(server.url) as client:
            payload = build_payload(RequestSpec("p", 7, 1), "fake-model", "completions", True)
            return [await send_request(client, endpoint_path("completions"), payload, 7) for _ in range(3)]
    assert all(r.success for r in asyncio.run(three_in_a_row()))
    assert server.connections == 1  # keep-alive
    server.drop_after_response, server.connections = True, 0
    results = asyncio.run(three_in_a_row())
    assert all(r.success for r in results), [r.error for r in results]
    assert server.connections == 3  # each stale connection replaced once


def test_chunked_decoder_on_any_split():
    from bench.common_http import ChunkedDecoder
    wire = b"5\r\nhello\r\n1;ext=1\r\n,\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\nNEXT"
    for step in (1, 2, 3, 7, len(wire)):
        decoder, out = ChunkedDecoder(), b""
        for i in range(0, len(wire), step):
            out += decoder.feed(wire[i:i + step])
        assert out == b"hello, world" and decoder.done


def test_sse_parser_handles_split_events_crlf_and_comments():
    p = SSEParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b': 1}\r\n\r\n: ping\n\ndata: [DO') == ['{"a": 1}']
    assert p.feed(b"NE]\n\n") == ["[DONE]"]


def test_max_concurrency_is_respected(server):
    server.scripts["*"] = [(0.1, "x", 1)]
    specs = [RequestSpec(f"q{i}", 7, 1) for i in range(6)]
    results, duration = asyncio.run(run_benchmark(specs, server.url, "fake-model", float("inf"),
                                                  max_concurrency=2))
    assert all(r.success for r in results)
    assert server.peak_in_flight == 2
    assert 0.3 - EPS <= duration <= 0.3 + 0.2  # three waves of two, not six in a row (0.6 s)


def test_all_requests_are_in_flight_together_without_a_limit(server):
    # 20 streams over several small connection pools: none waits for a connection
    server.scripts["*"] = [(0.3, "x", 1)]
    specs = [RequestSpec(f"q{i}", 7, 1) for i in range(20)]
    results, duration = asyncio.run(run_benchmark(specs, server.url, "fake-model", float("inf")))
    assert all(r.success for r in results) and server.peak_in_flight == 20
    assert duration < 0.3 + 0.3  # one wave, not 0.9 s in waves of 8


def test_a_stalled_request_times_out_and_the_rest_complete(server):
    server.scripts["*"] = [(0.05, "x", 1)]
    server.scripts["slow"] = [(5.0, "x", 1)]
    specs = [RequestSpec("slow", 7, 1)] + [RequestSpec(f"q{i}", 7, 1) for i in range(3)]
    results, duration = asyncio.run(run_benchmark(specs, server.url, "fake-model", float("inf"),
                                                  request_timeout_s=0.5))
    assert not results[0].success and "within 0.5 s" in results[0].error
    assert all(r.success for r in results[1:]) and duration < 2.0


def test_arrivals_follow_the_request_rate(server):
    server.scripts["*"] = [(0.0, "x", 1)]
    specs = [RequestSpec(f"q{i}", 7, 1) for i in range(8)]
    asyncio.run(run_benchmark(specs, server.url, "fake-model", 20.0, burstiness=float("inf")))
    # sends are scheduled at absolute times, so one stalled send (a loaded machine) is caught up on
    gaps = np.diff(server.arrivals)
    assert np.median(gaps) == pytest.approx(0.05, abs=0.01)
    assert server.arrivals[-1] - server.arrivals[0] == pytest.approx(0.35, abs=TOL)
    server.arrivals.clear()
    asyncio.run(run_benchmark(specs, server.url, "fake-model", float("inf")))
    assert server.arrivals[-1] - server.arrivals[0] < 0.05


@pytest.mark.skipif(not os.path.exists(QWEN_TOKENIZER), reason="needs the Qwen tokenizer file")
def test_serve_cli_writes_json_markdown_and_plots(server, tmp_path: Path):
    from bench.serve import main
    server.scripts["*"] = [(0.06, "x", 1)] + [(0.03, "y", 1)] * 3
    report = main(["--base-url", server.url, "--dataset", "random", "--input-len", "12",
                   "--output-len", "4", "--num-prompts", "4", "--sweep-rates", "50,inf",
                   "--goodput", "ttft:1000", "tpot:1", "--tokenizer", QWEN_TOKENIZER,
                   "--out-dir", str(tmp_path), "--label", "t"])
    assert report["model"] == "fake-model"
    saved = json.loads((tmp_path / "t.json").read_text())
    assert [run["request_rate"] for run in saved["runs"]] == [50.0, "inf"]
    for run in saved["runs"]:
        m = run["metrics"]
        assert m["completed"] == 4 and m["failed"] == 0 and m["total_output_tokens"] == 16
        assert 60 - 1000 * EPS <= m["mean_ttft_ms"] <= 60 + 1000 * TOL
        assert 30 - 1000 * EPS <= m["mean_tpot_ms"] <= 30 + 1000 * TOL
        assert m["request_goodput"] == 0.0  # every TPOT (~30 ms) misses the 1 ms SLO
    assert "TTFT" in (tmp_path / "t.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "t-sweep.png").stat().st_size > 0
    assert (tmp_path / "t-cdf-rate-inf.png").stat().st_size > 0


@pytest.mark.skipif(not os.path.exists(QWEN_TOKENIZER), reason="needs the Qwen tokenizer file")
def test_prefix_pairs_differ_only_in_the_last_token():
    from bench.common_data import allowed_token_ids, encode, load_tokenizer
    from bench.prefix_ttft import prompt_pair
    tok = load_tokenizer(QWEN_TOKENIZER)
    rng, allowed = np.random.default_rng(3), allowed_token_ids(tok)
    for n in (2, 17, 300, 2000):
        cold, warm = prompt_pair(tok, n, rng, allowed)
        c, w = encode(tok, cold), encode(tok, warm)
        assert len(c) == len(w) == n and c[:-1] == w[:-1] and c[-1] != w[-1]


@pytest.mark.skipif(not os.path.exists(QWEN_TOKENIZER), reason="needs the Qwen tokenizer file")
def test_prefix_ttft_cli_reports_cold_and_warm(server, tmp_path: Path):
    from bench.prefix_ttft import main
    server.scripts["*"] = [(0.08, "x", 1)]
    report = main(["--base-url", server.url, "--tokenizer", QWEN_TOKENIZER, "--lengths", "16,40",
                   "--repeats", "2", "--out-dir", str(tmp_path), "--label", "p"])
    assert [r["length"] for r in report["summary"]] == [16, 40]
    assert len(server.arrivals) == 1 + 2 * 2 * 2  # a probe, then cold + warm per length and repeat
    for row in report["summary"]:
        assert row["repeats"] == 2 and row["warm_cached_tokens"] == 3  # as the fake usage reports
        for key in ("cold_ttft_ms", "warm_ttft_ms"):
            assert 80 - 1000 * EPS <= row[key] <= 80 + 1000 * TOL
    assert json.loads((tmp_path / "p.json").read_text())["summary"] == report["summary"]
    assert "cold TTFT" in (tmp_path / "p.md").read_text()


def test_loopback_server_streams_at_its_interval():
    """bench/common_loopback (the stand-in that measures the client's own overhead), in its own process."""
    import socket
    import subprocess
    import sys
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "bench.common_loopback", "--port", str(port),
                             "--interval-ms", "40"], cwd=root)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        for endpoint in ("completions", "chat"):
            specs = [RequestSpec(f"q{i}", 3, 5) for i in range(4)]
            results, _ = asyncio.run(run_benchmark(specs, url, "loopback", float("inf"), endpoint=endpoint))
            for r in results:
                assert r.success and r.output_tokens == 5 and len(r.itl) == 4
                assert 0.04 - EPS <= r.ttft <= 0.04 + TOL and 0.04 - EPS <= tpot(r) <= 0.04 + TOL
    finally:
        proc.terminate()
        proc.wait(10)
