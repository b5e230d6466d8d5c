"""`openinfer serve --data-parallel-size 2` (the CPU) as clients, routers and operators meet it: one endpoint,
/metrics per engine, vLLM's X-data-parallel-rank header (a bad one a 400), each engine's KV events with its
rank on its own port, vllm-router's data-parallel mode over the one endpoint (kv_aware: every second turn
where its first turn's KV is; round_robin: about half), and kill -9 of one engine process stopping the server
with exit code 1 and leaving no process behind."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kv_event_subscriber import BlockStored, Subscriber, events_config
from memory.kv_pool import BLOCK_SIZE
from memory.prefix_hash import hash_chain
from test_kv_router import ONE_BLAS_THREAD, chat, kv_aware_against_round_robin
from test_reliability import Served, gone
from test_server_cli import OPENINFER, ROOT, free_port, interrupt, wait_healthy

pytestmark = pytest.mark.slow        # servers of two engine processes: 15-30 s each on 2 cores
ROUTER_KEY = "router-key"            # vllm-router's data-parallel mode sends one (this server asks for none)


@pytest.fixture(scope="module")
def server():
    """(url, events port) of the demo model served by two engine processes, publishing KV events (engine r on
    the port + r)."""
    port, events = free_port(), free_port_pair()
    proc = subprocess.Popen(OPENINFER + ["serve", "--device", "cpu", "--port", str(port), "-dp", "2",
                                         "--kv-events-config", json.dumps(events_config(events, topic=""))],
                            cwd=ROOT, env=ONE_BLAS_THREAD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=240)
        yield url, events
    finally:
        interrupt(proc)


def free_port_pair() -> int:
    """A free port whose next one is free too (engine 1 publishes on the port + 1)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def complete(url: str, prompt, rank: int | str | None = None) -> httpx.Response:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                      headers=headers, timeout=120)


def test_the_rank_header_picks_the_engine_and_metrics_report_each(server):
    url, _ = server
    before = metrics(url)
    for rank in (1, 1, 0):
        assert complete(url, "Hello there", rank).status_code == 200
    after = metrics(url)
    sent = [after[f'openinfer_data_parallel_requests_total{{engine="{r}"}}']
            - before.get(f'openinfer_data_parallel_requests_total{{engine="{r}"}}', 0) for r in (0, 1)]
    assert sent == [1, 2]
    for r in (0, 1):
        assert after[f'openinfer_engine_prompt_tokens_total{{engine="{r}"}}'] > 0
    assert after["openinfer_engine_prompt_tokens_total"] == sum(
        after[f'openinfer_engine_prompt_tokens_total{{engine="{r}"}}'] for r in (0, 1))
    assert after['openinfer_kv_cache_usage_perc{engine="0"}'] >= 0 and httpx.get(url + "/health").status_code == 200
    for bad in ("2", "-1", "one"):
        r = complete(url, "Hello", bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_data_parallel_rank", r.text


def test_each_engine_publishes_its_kv_events_with_its_rank_on_its_port(server):
    url, events = server
    subs = [Subscriber(events + r, topic="") for r in (0, 1)]
    try:
        prompts = {r: [2000 + 100 * r + t for t in range(3 * BLOCK_SIZE + 2)] for r in (0, 1)}
        for r in (1, 0):
            assert complete(url, prompts[r], r).status_code == 200
        for r, sub in enumerate(subs):
            chain = hash_chain(prompts[r], BLOCK_SIZE)
            sub.wait(lambda evs, chain=chain: set(chain) <= {h for e in evs if isinstance(e, BlockStored)
                                                             for h in e.block_hashes})
            assert {batch.data_parallel_rank for _, batch in sub.received} == {r}
            other = set(hash_chain(prompts[1 - r], BLOCK_SIZE))
            assert not other & {h for e in sub.events() if isinstance(e, BlockStored) for h in e.block_hashes}
    finally:
        for sub in subs:
            sub.close()


def test_vllm_routers_data_parallel_mode_sends_second_turns_where_their_kv_is(server):
    """vllm-router --intra-node-data-parallel-size 2 routes to url@rank with X-data-parallel-rank; kv_aware
    reads each rank's events from its own port. First turns go to the server pinned to a rank (two to one,
    two to the other, ...), second turns through the router."""
    url, events = server
    kv_aware_against_round_robin(
        [(url, [events, events + 1])],
        lambda i, messages: chat(url, messages, {"X-data-parallel-rank": str((i // 2) % 2)}),
        ("--intra-node-data-parallel-size", "2", "--api-key", ROUTER_KEY))


def descendants(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        for kid in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            out += [int(kid)] + descendants(int(kid))
    return out


def test_kill_9_of_one_engine_process_stops_the_server_and_leaves_no_process(tmp_path):
    served = Served.start(tmp_path, free_port(), "-dp", "2")
    try:
        engines = descendants(served.proc.pid)
        assert len(engines) == 2, engines
        os.kill(engines[1], signal.SIGKILL)
        served.proc.wait(60)
    finally:
        served.stop()
    log = served.log()
    assert served.proc.returncode == 1, log
    assert "replica 1: the engine process ended (killed by SIGKILL); the server stops (exit code 1)" in log, log
    assert all(gone(pid, within=10) for pid in engines), [p for p in engines if not gone(p, 0)]
    r = None
    try:
        r = httpx.get(served.url + "/health", timeout=2)
    except httpx.HTTPError:
        pass
    assert r is None, r
