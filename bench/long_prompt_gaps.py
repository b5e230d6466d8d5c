"""A long prompt joining running streams: the longest gap each stream sees while the prompt prefills, and
the longest engine steps of that time (the step trace).

    python -m bench.long_prompt_gaps                              # starts the demo model on the CPU
    python -m bench.long_prompt_gaps --long-tokens 2000 --n 16    # a 2,000-token prompt sampled 16 times
    python -m bench.long_prompt_gaps --server-args "--max-num-batched-tokens 2048"   # another step budget

The script starts `openinfer serve --device cpu --step-trace FILE` (plus --server-args). --streams
streaming completions (a short prompt, ignore_eos, up to --stream-tokens tokens) start; once each has
sent --warm tokens, a prompt of --long-tokens random token ids (n = --n, --long-max-tokens tokens) is
sent; once it is answered the streams are closed and the server stopped. Reported: the long request's
time to its first token; per stream the longest gap between its chunks while the long prompt prefilled;
the steps of that time from the trace: how many, the longest by wall time and by CPU time (the engine
thread's: with one BLAS thread, what the step takes on a core of its own, however loaded the machine) and
what each held.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench.common_server import start_server  # noqa: E402

PHASES = ("schedule", "copy", "build", "launch", "emit", "plan", "wait", "process")


async def stream(client: httpx.AsyncClient, prompt: str | list[int], max_tokens: int, times: list[float],
                 n: int = 1) -> None:
    """One streaming completion (n samples); the arrival time of each chunk goes to `times`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "n": n,
            "temperature": 0 if n == 1 else 1.0, "seed": 0}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())


async def workload(url: str, args) -> dict:
    rng = random.Random(args.seed)
    times: list[list[float]] = [[] for _ in range(args.streams)]
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        tasks = [asyncio.create_task(stream(client, f"Story {i}: once upon a time", args.stream_tokens, times[i]))
                 for i in range(args.streams)]
        while any(len(t) < args.warm for t in times):
            await asyncio.sleep(0.1)
            for task in tasks:
                if task.done():
                    task.result()                 # a failed stream fails the run
        ids = [rng.randrange(100, 40000) for _ in range(args.long_tokens)]
        sent = time.monotonic()
        first: list[float] = []
        await stream(client, ids, args.long_max_tokens, first, args.n)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = first[0]
    gaps = [max((b - a for a, b in zip(t, t[1:]) if b > sent and a < end), default=0.0) for t in times]
    return {"sent": sent, "first": end, "ttft_s": end - sent, "stream_gaps_s": gaps}


def trace_summary(path: str, start: float, end: float) -> dict:
    """The steps that began in [start, end] (the trace's monotonic clock): count, the longest by wall and
    by CPU time, and what those held."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    rows = [r for r in rows if start <= r["tm"] <= end]
    for r in rows:
        r["wall_ms"] = sum(r[p] for p in PHASES)
    held = ("wall_ms", "cpu_ms", "seqs", "prefill", "decode")
    worst_wall = max(rows, key=lambda r: r["wall_ms"], default=None)
    worst_cpu = max(rows, key=lambda r: r.get("cpu_ms") or 0.0, default=None)
    return {"steps": len(rows), "prefill_tokens": sum(r["prefill"] for r in rows),
            "worst_wall": {k: worst_wall.get(k) for k in held} if worst_wall else None,
            "worst_cpu": {k: worst_cpu.get(k) for k in held} if worst_cpu else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=18911)
    p.add_argument("--server-args", default="", help="more `openinfer serve` options (quoted)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=4000, help="tokens each stream asks for (it is closed "
                   "once the long request is answered)")
    p.add_argument("--warm", type=int, default=4, help="tokens every stream has sent before the long prompt goes")
    p.add_argument("--long-tokens", type=int, default=8101)
    p.add_argument("--long-max-tokens", type=int, default=4)
    p.add_argument("--n", type=int, default=1, help="samples of the long prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here as JSON")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="openinfer-long-prompt-")
    trace, log = os.path.join(folder, "steps.jsonl"), os.path.join(folder, "server.log")
    proc, url = start_server(["--device", "cpu", "--step-trace", trace] + shlex.split(args.server_args), args.port,
                             log, timeout_s=900)
    try:
        result = asyncio.run(workload(url, args))
    finally:
        proc.send_signal(2)                       # Ctrl-C: the engine closes (and flushes) its step trace
        proc.wait(60)
    result.update(trace_summary(trace, result["sent"], result["first"]), trace=trace, server_log=log,
                  args=vars(args))
    print(json.dumps({k: v for k, v in result.items() if k not in ("sent", "first")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
