"""Two CPU replicas of `openinfer serve` (the demo model) behind vllm-router, an existing KV-aware router
written for vLLM, on loopback. Its kv_aware policy subscribes to each replica's KV events (--kv-events-config)
and sends a request to the replica whose cache holds the longest prefix of it. Each conversation's first turn
goes straight to one replica, so the router can learn where its prefix lives only from the events; the
second turn, through the router, must then land there: usage.prompt_tokens_details.cached_tokens at least the
first turn's prompt rounded down to whole blocks. Behind the same router with round_robin, the second turns
alternate between the replicas and only those that happen to land on the right one hit."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kv_event_subscriber import events_config
from test_server_cli import OPENINFER, ROOT, free_port, interrupt, wait_healthy

from bench.common_data import load_tokenizer
from bench.scale_out import affinity_args, build_parser
from bench.scale_out_load import Workload, fill_ideal, run_conversations, texts
from engine.loader.demo import demo_model_path
from memory.kv_pool import BLOCK_SIZE

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# two replicas on a 2-core machine: BLAS threads of their own would only spin against each other (measured:
# 4.3 s of CPU per chat request with them under load, 0.5 s without)
ONE_BLAS_THREAD = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
CONVERSATIONS = 8                       # per policy
TOPICS = ["tides", "glaciers", "volcanoes", "comets", "coral reefs", "deserts", "auroras", "monsoons",
          "geysers", "fjords", "canyons", "lagoons", "tundra", "savannas", "estuaries", "atolls"]


def router_binary() -> str:
    found = shutil.which("vllm-router", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if found is None:
        pytest.skip("vllm-router is not installed (the test extra brings it)")
    return found


@pytest.fixture(scope="module")
def replicas():
    """[(url, events port)] of two demo-model servers publishing KV events."""
    procs, out = [], []
    try:
        for _ in range(2):
            port, events = free_port(), free_port()
            procs.append(subprocess.Popen(
                OPENINFER + ["serve", "--device", "cpu", "--port", str(port),
                             "--kv-events-config", json.dumps(events_config(events, topic=""))],
                cwd=ROOT, env=ONE_BLAS_THREAD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            out.append((f"http://127.0.0.1:{port}", events))
        for (url, _), proc in zip(out, procs):
            wait_healthy(url, proc, timeout=180)
        yield out
    finally:
        for proc in procs:
            interrupt(proc)


def start_router(replicas, policy: str, log, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """vllm-router over `replicas`, [(url, events port or ports: one per data-parallel rank)], on `policy`."""
    port = free_port()
    cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--prometheus-port", str(free_port()), "--worker-urls", *[url for url, _ in replicas], *extra]
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", demo_model_path()]
        for url, events in replicas:
            ports = events if isinstance(events, (list, tuple)) else [events]
            cmd += ["--kv-event-source", f"{url}=" + ",".join(f"tcp://127.0.0.1:{p}" for p in ports)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"vllm-router exited ({proc.returncode}): see {log.name}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "vllm-router not healthy within 60 s"
        time.sleep(0.2)


def chat(url: str, messages: list[dict], headers: dict | None = None) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def conversations(topics: list[str], first_turn, router: str, headers: dict | None = None) -> list[tuple[int, int]]:
    """(first turn's prompt tokens, second turn's cached tokens) of a two-turn chat per topic: the i-th first turn
    sent by first_turn(i, messages) straight to one replica (two to one, two to the other, ...), every second
    turn through the router."""
    firsts = []
    for i, topic in enumerate(topics):
        messages = [{"role": "system", "content": f"You answer questions about {topic} in one short sentence. "
                                                  f"Stay on {topic}; never change the subject away from {topic}."},
                    {"role": "user", "content": f"What should a first-time visitor know about {topic}?"}]
        reply = first_turn(i, messages)
        firsts.append((messages + [reply["choices"][0]["message"], {"role": "user", "content": "Why?"}],
                       reply["usage"]["prompt_tokens"]))
    time.sleep(0.5)                                              # the events' way to the router: milliseconds
    return [(tokens, chat(router, messages, headers)["usage"]["prompt_tokens_details"]["cached_tokens"])
            for messages, tokens in firsts]


def hits(turns: list[tuple[int, int]]) -> int:
    return sum(cached >= first // BLOCK_SIZE * BLOCK_SIZE > 0 for first, cached in turns)


def kv_aware_against_round_robin(workers, first_turn, extra: tuple[str, ...] = ()) -> None:
    """First turns through first_turn(i, messages), second turns through vllm-router over workers: kv_aware
    sends every one where its first turn's KV is, round_robin about half."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="vllm-router-") as log:
        kv_router, kv_url = start_router(workers, "kv_aware", log, extra)
        rr_router, rr_url = start_router(workers, "round_robin", log, extra)
        try:
            time.sleep(1.0)                                     # the router's subscriptions reach the publishers
            kv = conversations(TOPICS[:CONVERSATIONS], first_turn, kv_url)
            rr = conversations(TOPICS[CONVERSATIONS:2 * CONVERSATIONS], first_turn, rr_url)
        finally:
            for proc in (kv_router, rr_router):
                interrupt(proc)
        print(f"second turns with their whole first prompt cached: kv_aware {hits(kv)}/{len(kv)} {kv}, "
              f"round_robin {hits(rr)}/{len(rr)} {rr}")
        assert hits(kv) == CONVERSATIONS, f"kv_aware: {kv}; the router's log:\n{log.read()[-3000:]}"
        assert hits(rr) <= CONVERSATIONS // 2 + 1, rr


def test_second_turns_land_on_the_replica_holding_their_prefix(replicas):
    kv_aware_against_round_robin(replicas, lambda i, messages: chat(replicas[(i // 2) % 2][0], messages))


def test_overlapping_conversations_stay_where_their_history_is(replicas):
    """The scale-out bench's load (conversations whose turns overlap, one x-session-id each) through kv_aware as
    bench/scale_out.py runs it (its session affinity on): every follow-up turn lands where its previous turn's
    KV is, so it hits its ideal (the previous prompt and reply in whole blocks, from the replica's /tokenize).
    By its cost alone (prefix credit against load) kv_aware sends a turn whose replica is busy to the other one."""
    w = Workload(users=6, turns=3, system_prompts=2, system_tokens=64, user_tokens=32, output_tokens=8, seed=57,
                 think_ms=300)
    systems, messages = texts(load_tokenizer(demo_model_path()), w)
    with tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="vllm-router-") as log:
        router, url = start_router(replicas, "kv_aware", log,
                                   tuple(affinity_args(build_parser().parse_args([]), "kv_aware")))
        try:
            time.sleep(1.0)                                     # the router's subscriptions reach the publishers
            turns = asyncio.run(run_conversations(url, MODEL, systems, messages, w))
        finally:
            interrupt(router)
    asyncio.run(fill_ideal(replicas[0][0], MODEL, turns))
    assert [t.error for t in turns] == [""] * w.users * w.turns
    follow = [(t.user, t.turn, t.cached, t.ideal) for t in turns if t.turn > 0]
    assert all(ideal > 0 for *_, ideal in follow), follow
    assert [f for f in follow if f[2] < f[3]] == [], f"(user, turn, cached, ideal) below the ideal: {follow}"
