"""Reliability soak: many concurrent requests of mixed kinds against an openinfer server, a share of the
clients going away mid-request; afterwards the server must be idle with no KV block in use.

    python -m bench.soak --requests 1000 --rounds 3 --concurrency 64   # starts the demo model on the CPU
    python -m bench.soak --base-url http://127.0.0.1:8000 --requests 300 # a running server

Traffic (seeded): streaming and plain completions, streaming chats, some with n=2, stop strings or
logprobs; every 1/disconnect-rate-th client asks for the most tokens and leaves after its first chunks
(a stream) or times out (a plain request; one answered within 20 ms counts as completed).
An error: any status but 200, a stream without `data: [DONE]`, a finish_reason other than stop /
length, a transport failure. Leaked KV blocks: `openinfer_engine_kv_blocks_used` once
/metrics shows no request left. RSS: the server's (VmRSS, with its engine process), when this script
started it or --server-pid names it, after a warm-up and after each round of --requests (a leak grows round after
round; the KV pool's pages, touched for the first time, grow the first rounds only).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly box".split()


@dataclass
class SoakResult:
    requests: int = 0
    concurrency: int = 0
    completed: int = 0
    disconnected: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    leaked_kv_blocks: int | None = None
    requests_left: int | None = None
    rss_before_mib: float | None = None
    rss_after_mib: float | None = None
    rss_after_round_mib: list[float | None] = field(default_factory=list)
    seconds: float = 0.0


def request_body(rng: random.Random, i: int, max_tokens: int) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) + f" #{i}"
    body = {"max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.7, 1.0]), "seed": i}
    kind = rng.random()
    if kind < 0.2:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {**body, "stream": True}
    body.update(prompt=prompt, stream=kind < 0.8)
    if rng.random() < 0.15:
        body["n"] = 2
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS), "\n"]
    if rng.random() < 0.15:
        body["logprobs"] = 2
    return "/v1/completions", body


async def one_request(client: httpx.AsyncClient, path: str, body: dict, leave: bool, result: SoakResult,
                      timeout: float = 120.0) -> None:
    def fail(why: str) -> None:
        result.errors += 1
        if len(result.error_samples) < 10:
            result.error_samples.append(f"{path} {json.dumps(body)[:120]}: {why}")
    try:
        if not body.get("stream"):
            timeout = httpx.Timeout(60, read=0.02) if leave else timeout
            try:
                r = await client.post(path, json=body, timeout=timeout)
            except httpx.ReadTimeout:
                if leave:
                    result.disconnected += 1
                    return
                raise
            reasons = [c.get("finish_reason") for c in r.json().get("choices", [])] if r.status_code == 200 else []
            if r.status_code != 200 or not reasons or not set(reasons) <= {"stop", "length"}:
                return fail(f"{r.status_code} {r.text[:200]}")
            result.completed += 1
            return
        async with client.stream("POST", path, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return fail(f"{r.status_code} {(await r.aread())[:200]!r}")
            events, reasons = [], []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if leave and len(events) >= 2:
                    result.disconnected += 1
                    return
                if line[6:] != "[DONE]":
                    reasons += [c.get("finish_reason") for c in json.loads(line[6:]).get("choices", [])]
        finished = [x for x in reasons if x is not None]
        if not events or events[-1] != "[DONE]" or not finished or not set(finished) <= {"stop", "length"}:
            return fail(f"stream ended with {events[-2:]}")
        result.completed += 1
    except httpx.HTTPError as exc:
        fail(f"{type(exc).__name__}: {exc}")


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m.get("openinfer_engine_num_requests", 0) == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def rss_mib(pid: int | None) -> float | None:
    """VmRSS of the process and its children (the engine process, where the server runs one)."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except FileNotFoundError:            # a thread that ended meanwhile
            pass
    return kb / 1024 + sum(rss_mib(c) or 0.0 for c in children if os.path.exists(f"/proc/{c}"))


async def run_soak(url: str, requests: int = 300, concurrency: int = 64, disconnect_rate: float = 0.1,
                   max_tokens: int = 16, seed: int = 0, server_pid: int | None = None,
                   headers: dict | None = None, rounds: int = 1, timeout: float = 120.0) -> SoakResult:
    """`rounds` rounds of `requests` requests, at most `concurrency` at a time, each round waiting
    for the server to be idle."""
    rng = random.Random(seed)
    result = SoakResult(requests=requests * rounds, concurrency=concurrency)
    every = round(1 / disconnect_rate) if disconnect_rate > 0 else 0
    plan = []
    for i in range(requests * rounds):
        path, body = request_body(rng, i, max_tokens)
        leave = every > 0 and i % every == every - 1
        if leave:                       # long enough to be cut: the most tokens, no early EOS
            body.update(max_tokens=max_tokens, ignore_eos=True)
        plan.append((path, body, leave))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=headers) as client:
        warm = SoakResult()
        await asyncio.gather(*(one_request(client, *request_body(rng, -k, 4), False, warm) for k in range(4)))
        result.rss_before_mib = rss_mib(server_pid)
        t0 = time.monotonic()
        for r in range(rounds):
            queue = iter(plan[r * requests:(r + 1) * requests])

            async def worker() -> None:
                for path, body, leave in queue:
                    await one_request(client, path, body, leave, result, timeout)
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            idle = await asyncio.to_thread(wait_idle, url)
            result.rss_after_round_mib.append(rss_mib(server_pid))
        result.seconds = time.monotonic() - t0
    result.requests_left = int(idle.get("openinfer_engine_num_requests", -1))
    result.leaked_kv_blocks = int(idle.get("openinfer_engine_kv_blocks_used", -1))
    result.rss_after_mib = rss_mib(server_pid)
    return result


def start_server(args) -> tuple[subprocess.Popen, str]:
    from bench.common_server import start_server as start
    return start(["--device", "cpu", "--max-num-seqs", str(args.concurrency)]
                 + (["--model", args.model] if args.model else []), args.port, args.server_log)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="a running server (default: start one here on the CPU)")
    p.add_argument("--model", default=None, help="when starting the server: its --model (default: the demo)")
    p.add_argument("--port", type=int, default=18901)
    p.add_argument("--server-pid", type=int, default=None, help="the running server's pid, for its RSS")
    p.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(), "openinfer-soak-server.log"),
                   help="where the started server's log goes")
    p.add_argument("--requests", type=int, default=300, help="requests per round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-rate", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a client waits for its answer")
    p.add_argument("--json", default=None, help="write the result here as JSON")
    args = p.parse_args()
    proc, url, pid = None, args.base_url, args.server_pid
    if url is None:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        key = os.environ.get("OPENINFER_API_KEY")
        result = asyncio.run(run_soak(url, args.requests, args.concurrency, args.disconnect_rate, args.max_tokens,
                                      args.seed, pid, {"Authorization": f"Bearer {key}"} if key else None,
                                      args.rounds, args.timeout))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(json.dumps(asdict(result), indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=2))
    sys.exit(1 if result.errors or result.leaked_kv_blocks or result.requests_left else 0)


if __name__ == "__main__":
    main()
