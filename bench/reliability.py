"""Fault and abuse run against `openinfer serve` on the CPU (the demo model unless --model): the figures of
bench/results/reliability.md.

    python -m bench.reliability --json /tmp/reliability.json     # 17 minutes on 2 busy cores, one BLAS thread

Server A (the CPU defaults, an API key, a step trace):
  inputs   while --victims streams decode, each abusive input (tests/server/test_server_hardening.py's cases, headers
           and a body trickled one byte every 5 s, an 8,101-token prompt, a 2,000-token prompt with n=16): its
           outcomes, hangs, and the victims' worst stall ratio (bench/abuse.py);
  trickle  --tricklers connections trickling their headers one byte every 5 s for up to 60 s;
  soak     bench/soak.py: --soak-requests mixed requests, 10% of the clients leaving mid-request; leaks;
  drain    SIGTERM with --victims long streams running and new requests arriving: drain time, answers.
Server B (--enable-lora and a resolver folder): the adapter inputs (bench/abuse.py), then kill -9 of the
server (how long its engine process outlives it; a restart C on the same port) and kill -9 of C's engine
process (C's exit; a restart D). Steps: server A's step trace (the longest step, steps over 0.5 s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench import abuse  # noqa: E402
from bench.soak import run_soak  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}
STEP_PHASES = ("schedule", "copy", "build", "launch", "emit", "plan", "wait", "process")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    start_s: float
    started = []                       # every server process this run started (killed if the run fails)

    @classmethod
    def start(cls, args, port: int, *flags: str, timeout: float = 900) -> "Server":
        log = Path(args.workdir) / f"server-{port}-{time.strftime('%H%M%S')}.log"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--device", "cpu", "--port", str(port), "--api-key",
               KEY, *(["--model", args.model] if args.model else []), *flags]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        cls.started.append(proc)
        url = f"http://127.0.0.1:{port}"
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return cls(proc, url, log, time.monotonic() - t0)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        proc.kill()
        raise SystemExit(f"the server did not start; see {log}")

    def engine_pid(self) -> int:
        pid = self.proc.pid
        return next(int(k) for t in os.listdir(f"/proc/{pid}/task")
                    for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


def seconds_until_gone(pid: int, bound: float = 30.0) -> float | None:
    """Seconds until `pid` has exited (a zombie counts), None past `bound`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.02)
    else:
        return None
    return round(time.monotonic() - t0, 2)


@dataclass
class InputRow:
    input: str
    tried: int
    outcomes: dict
    worst_stall_ratio: float | None


async def run_inputs(client: httpx.AsyncClient, victims: abuse.Victims, inputs: list, repeat: int,
                     baseline: float) -> list[InputRow]:
    """Each (name, coroutine factory, times) in turn while the victims decode."""
    rows = []
    for name, make, times in inputs:
        outcomes: Counter = Counter()
        t0 = time.monotonic()
        for _ in range(times or repeat):
            outcomes[await make()] += 1
        ratio = await victims.stall_ratio(t0, time.monotonic(), baseline)
        rows.append(InputRow(name, sum(outcomes.values()), dict(outcomes), ratio and round(ratio, 1)))
        print(f"  {name}: {dict(outcomes)} stall x{ratio or 0:.1f}", file=sys.stderr, flush=True)
    return rows


def server_a_inputs(client: httpx.AsyncClient, url: str) -> list:
    """(name, coroutine factory, times or None for --repeat): the request cases, trickles, long prompts."""
    from tests.server.test_server_hardening import CASES

    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    out = []
    for case, method, path, content, headers, _, _ in CASES:
        hdrs = {"content-type": "application/json", **(AUTH if headers is None else headers)}
        out.append((case, lambda m=method, p=path, c=content, h=hdrs: abuse.http_input(client, m, p, c, h), None))
    form = {"content-type": "application/x-www-form-urlencoded", **AUTH}
    out.append(("a form-encoded body", lambda: abuse.http_input(client, "POST", "/v1/completions", b"prompt=x", form),
                None))
    body = abuse.HEAD + b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \""
    out += [("headers a byte every 5 s", lambda: abuse.trickle(host, int(port), abuse.HEAD, b"X-Slow: " + b"a" * 99,
                                                                 5.0, 60.0), 1),
            ("body a byte every 5 s", lambda: abuse.trickle(host, int(port), body, b"a" * 999, 5.0, 60.0), 1)]
    for name, tokens, n in (("8,101-token prompt", 8101, 1), ("2,000-token prompt, n=16", 2000, 16)):
        req = {"prompt": abuse.long_prompt(tokens), "max_tokens": 16, "n": n, "ignore_eos": True}
        out.append((name, lambda r=req: abuse.http_input(client, "POST", "/v1/completions", json.dumps(r).encode(),
                                                         {**JSON, **AUTH}, 600.0), 1))
    return out


async def phase_a(args, url: str) -> dict:
    """Inputs, trickle swarm and soak against server A; its victims' baseline gap. The client sends no API
    key of its own: each input brings its headers."""
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        victims = abuse.Victims(client, args.victims, AUTH)
        victims.start()
        baseline = await victims.baseline(args.baseline_s)
        print(f"victims' median gap {baseline * 1e3:.0f} ms", file=sys.stderr, flush=True)
        rows = await run_inputs(client, victims, server_a_inputs(client, url), args.repeat, baseline)
        host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
        t1 = time.monotonic()
        swarm = await abuse.trickle_swarm(host, int(port), args.tricklers, 5.0, 60.0)
        swarm_ratio = await victims.stall_ratio(t1, time.monotonic(), baseline)
        rows.append(InputRow(f"{args.tricklers:,} connections trickling headers (a byte every 5 s, up to 60 s)",
                             args.tricklers, swarm["outcomes"], swarm_ratio and round(swarm_ratio, 1)))
        await victims.stop()
    soak = await run_soak(url, args.soak_requests, 64, 0.1, 16, seed=0, headers=AUTH, timeout=600)
    return {"baseline_gap_ms": round(baseline * 1e3, 1), "inputs": [asdict(r) for r in rows], "trickle": swarm,
            "soak": asdict(soak)}


def arrivals(url: str, results: Counter, stop: threading.Event) -> None:
    """New requests on new connections until `stop`: their statuses (and Retry-After), or errors."""
    while not stop.is_set():
        for method, path in (("POST", "/v1/completions"), ("GET", "/health")):
            try:
                r = httpx.request(method, url + path, json={"prompt": "late", "max_tokens": 2}, headers=AUTH,
                                  timeout=30)
                results[f"{r.status_code}" + (" Retry-After" if "retry-after" in r.headers else "")] += 1
            except httpx.TimeoutException:
                results["hang"] += 1
            except httpx.HTTPError as exc:
                results[type(exc).__name__] += 1
        time.sleep(0.05)


def read_stream(url: str, body: dict, out: dict, key) -> None:
    """out[key] = (the last finish_reason, the last data payload) of a streamed completion, or the error."""
    reason, last = None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = line[6:]
                    if last != "[DONE]":
                        reason = next((c["finish_reason"] for c in json.loads(last).get("choices", [])
                                       if c.get("finish_reason")), reason)
        out[key] = f"{reason} {last}"
    except httpx.HTTPError as exc:
        out[key] = type(exc).__name__


def drain(server: Server, streams: int) -> dict:
    """SIGTERM with `streams` long streams running and requests arriving: the drain's figures."""
    out: dict = {}
    body = {"prompt": "Tell a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    jobs = [threading.Thread(target=read_stream, args=(server.url, body, out, i)) for i in range(streams)]
    for job in jobs:
        job.start()
    time.sleep(5)
    results: Counter = Counter()
    stop = threading.Event()
    late = threading.Thread(target=arrivals, args=(server.url, results, stop), daemon=True)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    late.start()
    code = server.proc.wait(120)
    took = time.monotonic() - t0
    stop.set()
    for job in jobs:
        job.join(60)
    endings = Counter(out.get(i, "no end") for i in range(streams))
    return {"drain_s": round(took, 2), "exit_code": code, "streams": dict(endings), "arrivals": dict(results)}


async def lora_phase(args, url: str, root: Path) -> list[InputRow]:
    """The adapter inputs (bench/abuse.py) against server B while its victims decode."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=600) as client:
        victims = abuse.Victims(client, max(2, args.victims // 2), AUTH)
        victims.start()
        baseline = await victims.baseline(args.baseline_s)
        inputs = []
        for name, body in abuse.lora_path_inputs(root):
            inputs.append((name, lambda b=body: abuse.http_input(client, "POST", "/v1/load_lora_adapter",
                                                                 json.dumps(b).encode(), JSON, 30.0), 1))
        for name, adapter, body in abuse.lora_inputs(root, *model_dims(args.model)):
            content = json.dumps({**body, "model": adapter}).encode()
            inputs.append((name, lambda c=content: abuse.http_input(client, "POST", "/v1/completions", c, JSON,
                                                                    30.0), 1))
        rows = await run_inputs(client, victims, inputs, 1, baseline)
        await victims.stop()
    return rows


def model_dims(model: str | None) -> tuple[int, int]:
    """(layers, hidden size) of the served model (an HF folder, or the demo model's)."""
    from engine.loader.demo import demo_model_path
    cfg = json.loads((Path(model or demo_model_path()) / "config.json").read_text())
    return cfg["num_hidden_layers"], cfg["hidden_size"]


def kills(args, server: Server, port: int) -> dict:
    """kill -9 of the server, then of a restarted server's engine process; each followed by a restart."""
    engine = server.engine_pid()
    server.proc.kill()
    server.proc.wait(30)
    out = {"kill -9 server: engine process gone after (s)": seconds_until_gone(engine)}
    second = Server.start(args, port)
    out["restart after kill -9 of the server (s)"] = round(second.start_s, 1)
    t0 = time.monotonic()
    os.kill(second.engine_pid(), signal.SIGKILL)
    try:
        code = second.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
        second.proc.kill()
    out["kill -9 engine process: server exit code"] = code
    out["kill -9 engine process: server exited after (s)"] = round(time.monotonic() - t0, 2)
    third = Server.start(args, port)
    out["restart after kill -9 of the engine process (s)"] = round(third.start_s, 1)
    third.stop()
    return out


def step_times(path: Path) -> dict:
    """Server A's steps: count, median, 99th percentile, longest, how many over 0.5 s (ms)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ms = sorted(sum(r[p] for p in STEP_PHASES) for r in rows)
    if not ms:
        return {"steps": 0}
    worst = max(rows, key=lambda r: sum(r[p] for p in STEP_PHASES))
    return {"steps": len(ms), "median_ms": round(statistics.median(ms), 1), "p99_ms": round(ms[int(len(ms) * 0.99)], 1),
            "max_ms": round(ms[-1], 1), "over_500ms": sum(m > 500 for m in ms),
            "longest": {k: worst[k] for k in ("seqs", "prefill", "decode")}}



def table(result: dict) -> str:
    """The markdown table of inputs: outcomes, hangs, worst stall ratio."""
    lines = ["| input | tried | outcomes (status: count) | worst stall ratio of other streams |",
             "| --- | --- | --- | --- |"]
    for row in result["inputs"] + result["lora_inputs"]:
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(row["outcomes"].items()))
        ratio = "-" if row["worst_stall_ratio"] is None else f"{row['worst_stall_ratio']:.1f}"
        lines.append(f"| {row['input']} | {row['tried']} | {outcomes} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="the served model (default: the demo)")
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--victims", type=int, default=8, help="streams decoding while the inputs run")
    p.add_argument("--baseline-s", type=float, default=5.0, help="seconds of victims alone before the inputs")
    p.add_argument("--repeat", type=int, default=3, help="times each request input is sent")
    p.add_argument("--tricklers", type=int, default=2000)
    p.add_argument("--soak-requests", type=int, default=500)
    p.add_argument("--workdir", default=tempfile.mkdtemp(prefix="openinfer-reliability-"))
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        run(args)
    finally:
        for proc in Server.started:          # a failed run leaves no server behind (their engines die with them)
            if proc.poll() is None:
                proc.kill()


def run(args) -> None:
    trace = Path(args.workdir) / "steps.jsonl"
    a = Server.start(args, args.port, "--step-trace", str(trace))
    result = {"start_s": round(a.start_s, 1), **asyncio.run(phase_a(args, a.url))}
    result["drain"] = drain(a, args.victims)
    result["steps"] = step_times(trace)
    root = Path(args.workdir) / "adapters"
    root.mkdir(exist_ok=True)
    b = Server.start(args, args.port + 1, "--enable-lora", "--allow-runtime-lora-updating", "--lora-resolver-dir",
                     str(root))
    result["lora_inputs"] = [asdict(r) for r in asyncio.run(lora_phase(args, b.url, root))]
    result["kills"] = kills(args, b, args.port + 1)
    print(json.dumps(result, indent=2))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
