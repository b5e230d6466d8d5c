"""The scale-out benchmark (issue 57): multi-turn conversations (bench/scale_out_load.py) over N engines on
one host (--replicas, 2 by default) — follow-up turns' TTFT p50 / p90 and their cache-hit rate against the ideal — routed three ways:

- router-kv_aware: N `openinfer serve` replicas publishing KV events (--kv-events-config) behind vllm-router's
  kv_aware policy, which sends a request to the replica of the lowest cost (the prompt tokens its cache does not
  hold, and its load); with its session affinity on (--kv-aware-session-affinity-ttl-secs, by default here), a
  conversation's turns (one `x-session-id` each) stay on the replica its first turn went to;
- router-round_robin: the same replicas behind vllm-router's round_robin;
- dp: one `openinfer serve --data-parallel-size N`, no router (its own dispatch: the least loaded engine, or a
  nearly as idle one holding a longer prefix; engine/process_dispatch.py).

The replicas start one after another and serve both router modes, their prefix caches reset in between; on
the GPU all share the one visible GPU (CUDA_VISIBLE_DEVICES=0), each with --num-kv-blocks (8000 by default:
128k tokens of Qwen3-4B KV; four replicas fit an 80 GB H100 at 2000), so the three modes get the same KV pools
(`-dp N` places its engines there too). A pool smaller than the conversations' histories is the cache-pressured
case: round robin then spreads every conversation over all replicas' caches and evicts. Every mode's conversations are its own
(other system prompts and messages: nothing one mode cached helps the next). Each server waits out its
engines' graph captures before its mode runs. Writes <label>.json and <label>.md into --out-dir: the date, the
machine, the command and each mode's figures, with the replicas' share of the requests (the servers' and
routers' logs go to a temporary folder, named at start).

    # the GPU (H100 / H200), Qwen3-4B random weights (written first, as bench/serve_gpu.py does):
    CUDA_VISIBLE_DEVICES=0 python bench/scale_out.py --random qwen3-4b --label scale-out-gpu \\
        --out-dir bench/results
    # four replicas, the cache pressured (each pool 32k tokens for 64 users' ~130k of history):
    CUDA_VISIBLE_DEVICES=0 python bench/scale_out.py --random qwen3-4b --replicas 4 --num-kv-blocks 2000 \\
        --label scale-out-gpu-4 --out-dir bench/results
    # eight replicas on eight GPUs, one each (the router's reference setting; -dp 8 gives its engines a GPU each):
    python bench/scale_out.py --random qwen3-4b --replicas 8 --gpus 8 --label scale-out-gpu-8 --out-dir bench/results
    # the CPU, the demo model, a small scale:
    python bench/scale_out.py --device cpu --users 8 --turns 4 --system-prompts 2 --system-tokens 128 \\
        --user-tokens 64 --output-tokens 16 --think-ms 2000 --out-dir bench/results
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common_data import load_tokenizer  # noqa: E402
from bench.scale_out_load import Workload, fill_ideal, run_conversations, summary, texts  # noqa: E402
from bench.serve_gpu import free_port, wait_warm  # noqa: E402
from memory.kv_pool import BLOCK_SIZE  # noqa: E402

MODES = ("router-kv_aware", "router-round_robin", "dp")
AFFINITY_TTL_S = 600                              # kv_aware's session affinity: a conversation idle this long is let go
GPU_KV_BLOCKS = 8000                              # per engine: 128k tokens of Qwen3-4B KV (18.9 GB)
GPU_COMMAND = ("CUDA_VISIBLE_DEVICES=0 python bench/scale_out.py --random qwen3-4b --label scale-out-gpu "
               "--out-dir bench/results")
CPU_NOTE = (f"These are CPU figures (the numpy engine, the demo model, a small scale): they show the modes work "
            f"and how the routing places turns, not the issue's GPU targets. The GPU figures (Qwen3-4B random "
            f"weights, 64 users x 6 turns, 2k-token system prompts, engines sharing one H100 / H200) are "
            f"bench/results/scale-out-gpu.md's: `{GPU_COMMAND}`.")


def serve(folder: str, device: str, extra: list[str], log: Path,
          env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`openinfer serve` of folder, healthy; its stderr in log."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", folder, "--device", device, "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/health", proc, f"the server (see {log})", 1200)
    return proc, url


def wait_for(url: str, proc: subprocess.Popen, what: str, limit_s: float) -> None:
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"{what}: no 200 from {url} in {limit_s:.0f} s")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def router_binary() -> str:
    found = shutil.which("vllm-router", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if found is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router; the test extra brings it)")
    return found


def start_router(policy: str, replicas: list[tuple[str, int]], model_folder: str, log: Path,
                 extra: list[str] | tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """vllm-router over replicas [(url, KV events port)] with `policy` (and extra arguments), healthy."""
    port = free_port()
    cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--prometheus-port", str(free_port()), "--worker-urls", *[url for url, _ in replicas], *extra]
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model_folder]
        cmd += [a for url, events in replicas for a in ("--kv-event-source", f"{url}=tcp://127.0.0.1:{events}")]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/health", proc, f"vllm-router (see {log})", 60)
    time.sleep(1.0)                     # its subscriptions reach the publishers
    return proc, url


def counters(url: str, prefix: str) -> dict[str, float]:
    """The /metrics samples whose name starts with prefix."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)}


def model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def run_mode(name: str, url: str, tokenize_url: str, tokenizer, workload: Workload) -> dict:
    """One mode's conversations through url, their ideal hits from tokenize_url, and the summary."""
    systems, messages = texts(tokenizer, workload)
    model = model_name(tokenize_url)
    turns = asyncio.run(run_conversations(url, model, systems, messages, workload))
    asyncio.run(fill_ideal(tokenize_url, model, turns))
    result = {"mode": name, **summary(turns)}
    print(json.dumps(result), flush=True)
    return result


def spread(before: list[dict], after: list[dict]) -> list[int]:
    """Requests each replica (or engine) served between two readings of its counters."""
    return [int(sum(a.values()) - sum(b.values())) for b, a in zip(before, after)]


@contextmanager
def replicas(args, folder: str, logs: Path, env: dict):
    """args.replicas `openinfer serve` publishing KV events: [(url, events port)], started one after another."""
    procs, served = [], []
    try:
        for r in range(args.replicas):
            events = free_port()
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
            own = dict(env, CUDA_VISIBLE_DEVICES=str(r % args.gpus)) if args.gpus > 1 else env
            proc, url = serve(folder, args.device, args.server_args + ["--kv-events-config", json.dumps(config)],
                              logs / f"replica{r}.log", own)
            procs.append(proc)
            served.append((url, events))
        for url, _ in served:
            wait_warm(int(url.rsplit(":", 1)[1]))
        yield served
    finally:
        for proc in procs:
            stop(proc)


def affinity_args(args, policy: str) -> list[str]:
    """kv_aware's session affinity (the conversations' x-session-id keeps a conversation on one replica)."""
    if policy != "kv_aware" or not args.session_affinity_ttl:
        return []
    return ["--kv-aware-session-affinity-ttl-secs", str(args.session_affinity_ttl)]


def router_modes(args, folder: str, logs: Path, tokenizer, env: dict) -> list[dict]:
    results = []
    policies = [m.split("-", 1)[1] for m in args.modes if m.startswith("router-")]
    with replicas(args, folder, logs, env) as served:
        for i, policy in enumerate(policies):
            for url, _ in served:
                urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=600)
            router, router_url = start_router(policy, served, folder, logs / f"router-{policy}.log",
                                              affinity_args(args, policy) + args.router_arg)
            try:
                before = [counters(url, "openinfer_request_success_total") for url, _ in served]
                result = run_mode(f"router-{policy}", router_url, served[0][0], tokenizer,
                                  replace(args.workload, seed=args.workload.seed + 1 + i))
                result["requests_per_replica"] = spread(before, [counters(u, "openinfer_request_success_total")
                                                                 for u, _ in served])
                results.append(result)
            finally:
                stop(router)
    return results


def dp_mode(args, folder: str, logs: Path, tokenizer, env: dict) -> dict:
    proc, url = serve(folder, args.device, args.server_args + ["--data-parallel-size", str(args.replicas)], logs / "dp.log", env)
    try:
        wait_warm(int(url.rsplit(":", 1)[1]))
        before = counters(url, "openinfer_data_parallel_requests_total{")
        result = run_mode("dp", url, url, tokenizer, replace(args.workload, seed=args.workload.seed + 100))
        after = counters(url, "openinfer_data_parallel_requests_total{")
        result["requests_per_replica"] = [int(after[k] - before.get(k, 0)) for k in sorted(after)]
        return result
    finally:
        stop(proc)


def machine() -> str:
    """CPU model, cores, memory, and the GPUs nvidia-smi names."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    mem = next((int(line.split()[1]) / 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0) \
        if os.path.exists("/proc/meminfo") else 0
    gpus = "no GPU"
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True)
        gpus = "; ".join(line.strip() for line in query.stdout.splitlines() if line.strip()) or gpus
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, {gpus}"


def ratios(modes: list[dict]) -> dict:
    """The issue's targets: kv_aware's follow-up TTFT p50 against round_robin's, and its hit over the ideal."""
    by = {m["mode"]: m for m in modes}
    kv, rr = by.get("router-kv_aware"), by.get("router-round_robin")
    out = {}
    if kv and rr and kv["follow_up_ttft_p50_ms"]:
        out["round_robin_over_kv_aware_ttft_p50"] = round(rr["follow_up_ttft_p50_ms"] / kv["follow_up_ttft_p50_ms"], 2)
    if kv:
        out["kv_aware_hit_over_ideal"] = kv["hit_over_ideal"]
    return out


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [f"# Scale-out: {w['users']} users × {w['turns']} turns over {report.get('replicas', 2)} engines, routed "
             f"{len(report['modes'])} ways", "",
             f"- date: {report['date']}", f"- machine: {report['machine']}", f"- model: {report['model']}",
             f"- command: `{report['command']}`",
             f"- server arguments (each engine): `{' '.join(report['server_args']) or '(defaults)'}`; "
             f"vllm-router's: `{' '.join(report.get('router_args', [])) or '(defaults)'}`; kv_aware's: "
             f"`{' '.join(report.get('kv_aware_args', [])) or '(defaults)'}`",
             f"- workload: {w['system_prompts']} shared system prompts of {w['system_tokens']} tokens; per turn a "
             f"{w['user_tokens']}-token message and a {w['output_tokens']}-token reply; closed loop, a user thinking "
             f"{w['think_ms']} ms on average (exponential) before each turn", "",
             "| mode | follow-up TTFT p50 (ms) | p90 (ms) | first turns' TTFT p50 (ms) | hit rate | ideal "
             "| hit / ideal | requests per engine | errors |", "| --- " * 9 + "|"]
    for m in report["modes"]:
        lines.append(f"| {m['mode']} | {m['follow_up_ttft_p50_ms']} | {m['follow_up_ttft_p90_ms']} "
                     f"| {m['first_turn_ttft_p50_ms']} | {m['hit_rate']} | {m['ideal_hit_rate']} "
                     f"| {m['hit_over_ideal']} "
                     f"| {' / '.join(map(str, m.get('requests_per_replica', [])))} | {m['errors']} |")
    r = report["targets"]
    if report.get("note"):
        lines += ["", report["note"]]
    said = [f"round_robin's follow-up TTFT p50 over kv_aware's: {r['round_robin_over_kv_aware_ttft_p50']}× "
            f"(target ≥ 3×)"] if "round_robin_over_kv_aware_ttft_p50" in r else []
    said += [f"kv_aware's hit over the ideal: {r['kv_aware_hit_over_ideal']} (target ≥ 0.9)"] \
        if "kv_aware_hit_over_ideal" in r else []
    if said:
        lines += ["", "; ".join(said)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--folder", default=None, help="the model folder (default: --random's weights, or on the CPU the "
                                                  "demo model)")
    p.add_argument("--random", default=None, metavar="MODEL", help="write random weights of bench/configs/MODEL "
                                                                   "first (e.g. qwen3-4b) and serve them")
    p.add_argument("--weights-dir", default="/tmp", help="where --random's weights are written")
    for name in ("users", "turns", "system_prompts", "system_tokens", "user_tokens", "output_tokens", "seed",
                 "think_ms"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--replicas", type=int, default=2, help="engines: the router modes' replicas, dp's -dp")
    p.add_argument("--gpus", type=int, default=1, help="GPUs to spread the router modes' replicas over (replica r "
                   "on GPU r %% N: one each at N = --replicas, the issue's 8-replica form); 1: every replica on "
                   "the one visible GPU")
    p.add_argument("--num-kv-blocks", type=int, default=None, help=f"each engine's KV blocks (on the GPU "
                                                                   f"{GPU_KV_BLOCKS} unless given; the CPU: the "
                                                                   f"server's default unless given)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--server-arg", action="append", default=[], help="an `openinfer serve` argument for every "
                                                                     "server (repeat)")
    p.add_argument("--router-arg", action="append", default=[], help="a vllm-router argument for both router "
                                                                     "modes (repeat; e.g. --router-arg=--router-"
                                                                     "temperature --router-arg=0.5)")
    p.add_argument("--session-affinity-ttl", type=int, default=AFFINITY_TTL_S, metavar="S",
                   help="kv_aware's --kv-aware-session-affinity-ttl-secs (0: affinity off, the cost alone places "
                        "each turn)")
    p.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS of each server on the CPU")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--label", default="scale-out")
    p.add_argument("--machine", default=None, help="the machine as the report names it (default: read from "
                                                   "/proc and nvidia-smi)")
    return p


def model_folder(args) -> str:
    if args.folder:
        return args.folder
    if args.random:
        from bench.decode import random_weights_folder
        from bench.serve_gpu import write_weights

        folder = random_weights_folder(args.random, None, args.weights_dir)
        write_weights(args.random, folder)
        return folder
    if args.device == "cpu":
        from engine.loader.demo import demo_model_path
        return demo_model_path()
    raise SystemExit("give --folder or --random on the GPU")


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := set(args.modes) - set(MODES):
        raise SystemExit(f"unknown mode(s) {', '.join(sorted(unknown))}")
    if not 0 <= args.session_affinity_ttl <= 31_536_000:
        raise SystemExit("--session-affinity-ttl: 0 (off) or 1 to 31536000 seconds, as vllm-router takes it")
    args.workload = Workload(args.users, args.turns, args.system_prompts, args.system_tokens, args.user_tokens,
                             args.output_tokens, args.seed, args.think_ms)
    if not 1 <= args.replicas <= 16:
        raise SystemExit("--replicas: 1 to 16")
    blocks = args.num_kv_blocks or (GPU_KV_BLOCKS if args.device == "cuda" else None)
    args.server_args = (["--num-kv-blocks", str(blocks)] if blocks else []) + args.server_arg
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="scale-out-logs-"))        # the servers' and routers' logs
    print(f"logs in {logs}", flush=True)
    folder = model_folder(args)
    tokenizer = load_tokenizer(folder)
    threads = str(args.blas_threads)
    env = dict(os.environ, **({"OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
                              if args.device == "cpu" else {}))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": args.machine or machine(), "model": args.random or folder,
              "command": "python bench/scale_out.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "workload": asdict(args.workload), "replicas": args.replicas, "server_args": args.server_args,
              "router_args": args.router_arg, "kv_aware_args": affinity_args(args, "kv_aware"), "modes": []}
    if any(m.startswith("router-") for m in args.modes):
        report["modes"] += router_modes(args, folder, logs, tokenizer, env)
    if "dp" in args.modes:
        report["modes"].append(dp_mode(args, folder, logs, tokenizer, env))
    report["targets"] = ratios(report["modes"])
    if args.device == "cpu":
        report["note"] = CPU_NOTE
    (out / f"{args.label}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{args.label}.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
