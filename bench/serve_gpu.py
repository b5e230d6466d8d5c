"""The serving benchmark on the GPU host: the real server on a real-shape model with random bf16 weights.

Per model: random weights are written once (harness.models.write_random_qwen3, in a subprocess so its
torch memory is gone before the server starts), then `openinfer serve` starts with vLLM's defaults
(256 sequences, 8192 tokens per step) and a step trace; start-to-healthy (spawn to /health 200) and
the server's RSS are measured; then `bench.serve` runs the scenarios against it: concurrency 1,
a rate sweep (and rate inf), each with random 1024-token prompts and 128 output tokens. Writes
serve-<model>.json / .md, the step traces and their tables (bench/step_profile.py) under --out-dir; each
rate's run also carries its phase's bare decode step (the decode-graph steps' mean GPU span and batch) and
its median TPOT over it (`tpot_over_bare_step`: the 16 req/s target's ratio); the c1 scenario's request
trace (`--request-trace`) splits its TTFT into the request's gaps (`c1_ttft_gaps_ms`, bench/request_trace.py).

    python bench/serve_gpu.py --models qwen3-4b --out-dir $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import serve as serve_bench  # noqa: E402
from bench.common_report import plot_sweep  # noqa: E402
from bench import request_trace  # noqa: E402
from bench.step_profile import bare_decode, load, split_phases, summarize, table  # noqa: E402

# scenario -> bench.serve arguments (prompts per run, rate or concurrency)
SCENARIOS = {
    "c1": ["--num-prompts", "24", "--max-concurrency", "1", "--request-rate", "inf"],
    "sweep": ["--num-prompts", "400", "--sweep-rates", "16,64"],
    "low": ["--num-prompts", "40", "--sweep-rates", "1,4"],
    "inf": ["--num-prompts", "1000", "--request-rate", "inf"],
}
# scenario "prefix": bench/prefix_ttft.py's cold / warm-HBM / host-tier TTFT sweep (median of 3, token-id
# prompts as the issue measured them) against a server with a host KV tier, and the pinned host -> device
# bandwidth measured in the same run
PREFIX_LENGTHS = "256,1024,4096,16384,32768"
PREFIX_SERVER_ARGS = ["--kv-offload-gib", "24"]


def pinned_h2d_gb_s(nbytes: int = 1 << 30) -> float:
    """One pinned host -> device copy of `nbytes`, best of 5 (the host tier's link roofline), in a child
    process so that no CUDA context of this one stays beside the server."""
    code = ("import cupy, sys; n = int(sys.argv[1]); h = cupy.cuda.alloc_pinned_memory(n); d = cupy.cuda.alloc(n); "
            "s = cupy.cuda.Stream(non_blocking=True); a, b = cupy.cuda.Event(), cupy.cuda.Event(); best = 1e9\n"
            "for _ in range(5):\n"
            "    a.record(s); cupy.cuda.runtime.memcpyAsync(d.ptr, h.ptr, n, cupy.cuda.runtime.memcpyHostToDevice, "
            "s.ptr); b.record(s); b.synchronize()\n"
            "    best = min(best, cupy.cuda.get_elapsed_time(a, b))\n"
            "print(n / best / 1e6)")
    return float(subprocess.run([sys.executable, "-c", code, str(nbytes)], capture_output=True, text=True,
                                check=True).stdout.split()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of the server: its process and its children (the engine process)."""
    total = 0.0
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            total += int(line.split()[1]) / 1024
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        children = []
    return total + sum(rss_mib(int(c)) for c in children)


def write_weights(model: str, folder: str, layers: int | None = None) -> None:
    """Random weights of bench/configs/<model> (its first `layers` layers where given) into folder."""
    from bench.decode import config_path

    code = ("from harness.models import write_random_qwen3; import sys; "
            "write_random_qwen3(sys.argv[1], sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, config_path(model, layers), folder], cwd=ROOT, check=True)


def request_trace_path(step_trace: Path) -> str:
    """The request trace beside a scenario's step trace (server/request_trace.py)."""
    return str(step_trace).replace("steps-", "requests-", 1)


def start_server(folder: str, port: int, trace: Path, extra: list[str],
                 device: str = "cuda") -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", folder, "--device", device, "--port", str(port),
           "--step-trace", str(trace), "--request-trace", request_trace_path(trace), "--log-level", "warning", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(str(trace) + ".log", "w"))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {trace}.log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - t0
        except OSError:
            pass
        if time.perf_counter() - t0 > 600:
            proc.kill()
            raise RuntimeError("server not healthy in 600 s")
        time.sleep(0.05)


def wait_warm(port: int, limit_s: float = 300.0) -> float:
    """Seconds until the engine's idle-time graph captures are done (/metrics openinfer_engine_warming_up
    0): scenarios measure the warm engine, not requests queued behind a capture."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                if "openinfer_engine_warming_up 0" in r.read().decode():
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"engine still warming up after {limit_s:.0f} s")


def scaled(args: list[str], scale: float) -> list[str]:
    """A scenario's arguments with its prompt count scaled (smoke runs)."""
    out = list(args)
    i = out.index("--num-prompts") + 1
    out[i] = str(max(2, int(int(out[i]) * scale)))
    return out


def run_model(model: str, scenarios: list[str], out: Path, tokenizer: str, extra: list[str],
              device: str = "cuda", folder: str | None = None, scale: float = 1.0, input_len: int = 1024,
              prefix_lengths: str = PREFIX_LENGTHS, layers: int | None = None, weights_dir: str = "/tmp") -> dict:
    if folder is None:
        from bench.decode import random_weights_folder

        folder = random_weights_folder(model, layers, weights_dir)
        write_weights(model, folder, layers)
    port = free_port()
    result: dict = {"model": model, "layers": layers, "server_args": extra}
    if "prefix" in scenarios and device == "cuda":
        result["pinned_h2d_gb_s"] = round(pinned_h2d_gb_s(), 1)
    for name in scenarios:                          # a fresh server per scenario: its own trace
        trace = out / f"steps-{model}-{name}.jsonl"
        proc, healthy_s = start_server(folder, port, trace, (PREFIX_SERVER_ARGS if name == "prefix" else []) + extra,
                                       device)
        result.setdefault("start_to_healthy_s", []).append(round(healthy_s, 2))
        result.setdefault("rss_mib_healthy", []).append(round(rss_mib(proc.pid), 1))
        try:
            result.setdefault("healthy_to_warm_s", []).append(round(wait_warm(port), 2))
            if name == "prefix":
                result["prefix"] = run_prefix(model, port, out, tokenizer, prefix_lengths)
            else:
                report = serve_bench.main(["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", tokenizer,
                                           "--input-len", str(input_len), "--output-len", "128", "--out-dir",
                                           str(out), "--label", f"serve-{model}-{name}", "--no-plots",
                                           *scaled(SCENARIOS[name], scale)])
                result[name] = [{"rate": r["request_rate"], **r["metrics"], "errors": r["errors"]}
                                for r in report["runs"]]
                if name != "c1":
                    result.setdefault("sweep_runs", []).extend(report["runs"])
            result.setdefault("rss_mib_after", []).append(round(rss_mib(proc.pid), 1))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        rows = load(str(trace))
        if rows:
            text = table(summarize(rows))
            (out / f"steps-{model}-{name}.md").write_text(text + "\n")
            print(text, flush=True)
            attach_bare_steps(result.get(name), rows)
            requests = Path(request_trace_path(trace))
            if name == "c1" and requests.exists():          # where a lone request's TTFT goes
                gaps = request_trace.breakdown(request_trace.load(str(requests)), [r for r in rows if "tm" in r])
                result["c1_ttft_gaps_ms"] = {k: round(sorted(v)[len(v) // 2], 3) for k, v in gaps.items() if v}
                print(request_trace.table(gaps), flush=True)
    runs = sorted(result.pop("sweep_runs", []), key=lambda r: float(r["request_rate"]))
    if runs:
        plot_sweep(runs, out / f"serve-{model}-sweep.png", f"{model} on one H200: random 1024/128")
    return result


def attach_bare_steps(runs: list[dict] | None, rows: list[dict]) -> None:
    """Each rate's bare decode step (the mean GPU span of its phase's decode-graph steps, bench/step_profile.py)
    and its median TPOT over it: the issue's "median TPOT <= 1.3 x the bare decode step at that batch"."""
    if not runs:
        return
    for run, phase in zip(runs, split_phases(rows, len(runs))):
        bare = bare_decode(phase)
        if bare is not None:
            run["bare_decode"] = {k: round(v, 3) for k, v in bare.items()}
            run["tpot_over_bare_step"] = round(run["median_tpot_ms"] / bare["gpu_ms"], 3)


def run_prefix(model: str, port: int, out: Path, tokenizer: str, lengths: str) -> dict:
    from bench import prefix_ttft

    return prefix_ttft.main(["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", tokenizer, "--lengths",
                             lengths, "--repeats", "3", "--host-tier", "--token-ids", "--out-dir", str(out),
                             "--label", f"prefix-{model}"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-4b")
    p.add_argument("--scenarios", default="c1,sweep,inf")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "bench/out"))
    p.add_argument("--tokenizer", default=os.environ.get("OPENINFER_TEST_TOKENIZER", "/work/shared/models/qwen-tokenizer"))
    p.add_argument("--server-arg", action="append", default=[], help="extra `openinfer serve` argument (repeat)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script on a small --folder model")
    p.add_argument("--folder", default=None, help="serve this model folder (no random weights written)")
    p.add_argument("--scale", type=float, default=1.0, help="scale every scenario's prompt count (smoke runs)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--prefix-lengths", default=PREFIX_LENGTHS, help="the prefix scenario's prompt lengths")
    p.add_argument("--layers", type=int, default=None, help="serve only the first N layers (a host disk too small)")
    p.add_argument("--weights-dir", default="/tmp", help="where the random weights are written (e.g. /dev/shm)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {m: run_model(m, args.scenarios.split(","), out, args.tokenizer, args.server_arg, args.device,
                            args.folder, args.scale, args.input_len, args.prefix_lengths, args.layers,
                            args.weights_dir)
               for m in args.models.split(",")}
    (out / "serve-gpu-raw.json").write_text(json.dumps(results, indent=2))
    bundle(out)
    return results


def bundle(out: Path) -> None:
    """Everything but the raw JSON and the plots into one archive (a GPU host may return few files)."""
    import tarfile

    keep = {"serve-gpu-raw.json"}
    with tarfile.open(out / "serve-gpu-runs.tar.gz", "w:gz") as tar:
        for f in sorted(out.iterdir()):
            if f.is_file() and f.name not in keep and not f.name.endswith((".png", ".tar.gz")):
                tar.add(f, arcname=f.name)
                f.unlink()


if __name__ == "__main__":
    main()
