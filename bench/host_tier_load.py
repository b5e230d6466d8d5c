"""Host-tier restores under load: what a long prefix coming back from host memory costs the running decodes,
with the synchronous host tier and with OPENINFER_ASYNC_HOST_TIER=1, each on a fresh `openinfer serve`.

Per setting: the server starts with a host KV tier (--kv-offload-gib); the long prompts are sent once (cold,
one token out) and POST /reset_prefix_cache moves their blocks to the host tier; then --streams streaming
requests with short prompts decode --stream-tokens tokens each, and while they run each long prompt is sent
again (one token out: a host-tier hit), one at a time, --hit-gap-s apart. Reported: the streams'
inter-token gaps that overlap a hit (from its send to its first token) vs all the others (p50, p99, max),
the hits' TTFT and cached tokens, and the streams' output tok/s. The server, not the engine in-process:
the gaps a client sees include the server's streaming path, which is what a user's decode stalls on.
Prompts are token-id lists (no tokenizer needed).

    python bench/host_tier_load.py --out-dir $OUT                                # qwen3-4b, random weights
    python bench/host_tier_load.py --device cpu --streams 4 --hit-len 256 ...   # a smoke run: the demo model
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.common import RequestSpec, build_payload, first_model, make_client, send_request  # noqa: E402
from bench.common_server import start_server  # noqa: E402
from bench.serve_gpu import free_port, wait_warm, write_weights  # noqa: E402


def prompts(rng: np.random.Generator, count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` random token-id prompts of `length` tokens (ids 100..vocab: no special tokens)."""
    return [rng.integers(100, vocab, length).tolist() for _ in range(count)]


async def post(client, model: str, ids: list[int], output_len: int):
    payload = build_payload(RequestSpec(ids, len(ids), output_len), model, "completions", True)
    result = await send_request(client, "/v1/completions", payload, len(ids))
    if not result.success:
        raise RuntimeError(f"a {len(ids)}-token request failed: {result.error}")
    return result


async def host_hit_tokens(client) -> float:
    """The engine's prefix-cache tokens restored from the host tier so far (GET /metrics)."""
    async with client.request("GET", "/metrics") as response:
        text = (await response.read()).decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("openinfer_engine_prefix_cache_host_hits"))


async def load_run(url: str, streams: list[list[int]], hits: list[list[int]], stream_tokens: int,
                   lead_s: float, hit_gap_s: float) -> dict:
    """Warm the hit prompts and move them to the host tier, then the streams with the hits among them."""
    async with make_client(url) as client:
        model = await first_model(client)
        for ids in hits:                                     # cold, then the device copy goes to the host tier
            await post(client, model, ids, 1)
        async with client.request("POST", "/reset_prefix_cache") as reset:
            if reset.status != 200:
                raise RuntimeError(f"POST /reset_prefix_cache answered {reset.status}")
        restored_before = await host_hit_tokens(client)
        start = time.perf_counter()
        tasks = [asyncio.create_task(post(client, model, ids, stream_tokens)) for ids in streams]
        await asyncio.sleep(lead_s)
        hit_results = []
        for ids in hits:
            hit_results.append(await post(client, model, ids, 1))
            await asyncio.sleep(hit_gap_s)
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        restored = await host_hit_tokens(client) - restored_before
    return {**gap_summary(done, hit_results, duration), "host_tier_restored_tokens": restored}


def gap_summary(done, hit_results, duration: float) -> dict:
    """Split the streams' inter-token gaps into those overlapping a hit's wait and the rest."""
    windows = [(h.start_time, h.start_time + h.ttft) for h in hit_results]
    during, outside = [], []
    for r in done:
        t = r.start_time + r.ttft
        for gap in r.itl:
            lo, t = t, t + gap
            (during if any(lo < b and t > a for a, b in windows) else outside).append(gap * 1000)

    def stats(values: list[float]) -> dict:
        if not values:
            return {"n": 0, "p50": None, "p99": None, "max": None}
        return {"n": len(values), "p50": float(np.percentile(values, 50)),
                "p99": float(np.percentile(values, 99)), "max": float(max(values))}
    tokens = sum(r.output_tokens for r in done)
    return {"gaps_during_hits_ms": stats(during), "gaps_without_hits_ms": stats(outside),
            "hit_ttft_ms": [h.ttft * 1000 for h in hit_results],
            "hit_cached_tokens": [h.cached_tokens for h in hit_results],
            "output_tok_s": tokens / duration, "duration_s": duration}


def serve_args(args, folder: str | None) -> list[str]:
    model = ["--model", folder] if folder else []
    return [*model, "--device", args.device, "--kv-offload-gib", str(args.offload_gib), "--log-level", "warning",
            *args.server_arg]


def run_setting(args, folder: str | None, async_tier: bool, out: Path) -> dict:
    """A fresh server with OPENINFER_ASYNC_HOST_TIER set, the load run against it."""
    os.environ["OPENINFER_ASYNC_HOST_TIER"] = "1" if async_tier else "0"   # the server inherits it
    rng = np.random.default_rng(args.seed)
    streams = prompts(rng, args.streams, args.stream_len, args.vocab)
    hits = prompts(rng, args.hits, args.hit_len, args.vocab)
    port = free_port()
    proc, url = start_server(serve_args(args, folder), port, str(out / f"server-async{int(async_tier)}.log"))
    try:
        wait_warm(port)                               # the idle-time graph captures done: none among the gaps
        asyncio.run(load_run(url, prompts(rng, 1, 16, args.vocab), [], 4, 0, 0))   # warm-up
        return asyncio.run(load_run(url, streams, hits, args.stream_tokens, args.lead_s, args.hit_gap_s))
    finally:
        proc.terminate()
        proc.wait(60)


def markdown(report: dict) -> str:
    def cell(stat: dict, key: str) -> str:
        return "n/a" if stat[key] is None else f"{stat[key]:.1f}"
    sync, asyn = report["sync"], report["async"]
    rows = [("stream gap p50 / p99 / max during hits (ms)", "gaps_during_hits_ms"),
            ("stream gap p50 / p99 / max without hits (ms)", "gaps_without_hits_ms")]
    lines = ["| | OPENINFER_ASYNC_HOST_TIER=0 | OPENINFER_ASYNC_HOST_TIER=1 |", "| --- | --- | --- |"]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(
            f"{cell(r[key], 'p50')} / {cell(r[key], 'p99')} / {cell(r[key], 'max')} (n={r[key]['n']})"
            for r in (sync, asyn)) + " |")
    lines.append("| hit TTFT median (ms) | " + " | ".join(f"{np.median(r['hit_ttft_ms']):.1f}" for r in (sync, asyn))
                 + " |")
    lines.append("| hit cached tokens | " + " | ".join(str(r["hit_cached_tokens"]) for r in (sync, asyn)) + " |")
    lines.append("| tokens restored from the host tier | " + " | ".join(
        f"{r['host_tier_restored_tokens']:.0f}" for r in (sync, asyn)) + " |")
    lines.append("| stream output tok/s | " + " | ".join(f"{r['output_tok_s']:.1f}" for r in (sync, asyn)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cpu: a smoke run on the demo model (or --folder)")
    p.add_argument("--model", default="qwen3-4b", help="bench/configs model written with random weights (cuda)")
    p.add_argument("--folder", default=None, help="serve this model folder (no random weights written)")
    p.add_argument("--weights-dir", default="/tmp")
    p.add_argument("--vocab", type=int, default=100000, help="prompt token ids are drawn below this")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-len", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=2048, help="long enough to outlast the hits")
    p.add_argument("--hits", type=int, default=4)
    p.add_argument("--hit-len", type=int, default=16384)
    p.add_argument("--lead-s", type=float, default=1.0, help="streams alone before the first hit")
    p.add_argument("--hit-gap-s", type=float, default=0.5)
    p.add_argument("--offload-gib", type=float, default=24.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `openinfer serve` argument (repeat)")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "bench/out"))
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folder = args.folder
    if folder is None and args.device != "cpu":
        folder = f"{args.weights_dir}/host-tier-load-{args.model}"
        if not Path(folder, "config.json").exists():
            write_weights(args.model, folder)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
              "command": "python bench/host_tier_load.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "model": folder or "demo", "args": vars(args)}
    for key, async_tier in (("sync", False), ("async", True)):
        report[key] = run_setting(args, folder, async_tier, out)
        print(key, json.dumps(report[key]), flush=True)
    (out / "host-tier-load.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out / "host-tier-load.md").write_text(f"# Host-tier restores under load: {report['model']}\n\n"
                                          f"- date: {report['date']}\n- machine: {report['machine']}\n"
                                          f"- command: `{report['command']}`\n\n{table}\n")
    print(table, flush=True)
    return report


if __name__ == "__main__":
    try:
        main()
    except (ValueError, RuntimeError, OSError) as exc:
        sys.exit(f"error: {exc}")
