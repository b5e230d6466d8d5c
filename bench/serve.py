"""Serving benchmark for any OpenAI-compatible server, measured the way `vllm bench serve` measures.

Requests arrive with gamma-distributed gaps (burstiness 1 = Poisson) or all at once (rate inf), each a
streaming completion with usage in its last chunk; `ignore_eos` + `min_tokens` pin the output length.
Reports TTFT / TPOT / ITL / E2E latency (mean, median, p90, p99), request and token throughput and
goodput against SLOs, as JSON, a markdown summary and PNG plots.

    python -m bench.serve --base-url http://127.0.0.1:8000 --dataset random --input-len 1024 \
        --output-len 128 --num-prompts 200 --sweep-rates 1,2,4,8,inf
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import (RequestResult, RequestSpec, auth_headers, build_payload,  # noqa: E402
                          endpoint_path, first_model, make_client, send_request)
from bench.common_data import load_tokenizer, random_requests, sharegpt_requests  # noqa: E402
from bench.common_metrics import arrival_offsets, parse_slos, summarize  # noqa: E402
from bench.common_report import plot_cdfs, plot_sweep, run_table, sweep_table  # noqa: E402


async def run_benchmark(specs: list[RequestSpec], base_url: str, model: str, request_rate: float,
                        burstiness: float = 1.0, max_concurrency: int | None = None,
                        endpoint: str = "completions", ignore_eos: bool = True, seed: int = 0,
                        api_key: str | None = None, extra_body: dict | None = None,
                        request_timeout_s: float = 6 * 3600.0) -> tuple[list[RequestResult], float]:
    """Send every spec on the arrival schedule; returns the per-request results (in spec order) and
    the wall time from the first send to the last response."""
    path = endpoint_path(endpoint)
    headers = auth_headers(api_key)
    offsets = arrival_offsets(len(specs), request_rate, burstiness, np.random.default_rng(seed))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with make_client(base_url) as client:
        async def timed(spec: RequestSpec) -> RequestResult:
            payload = build_payload(spec, model, endpoint, ignore_eos, extra_body)
            try:
                return await asyncio.wait_for(send_request(client, path, payload, spec.prompt_len, headers),
                                              request_timeout_s)
            except asyncio.TimeoutError:
                return RequestResult(prompt_len=spec.prompt_len,
                                     error=f"no complete response within {request_timeout_s:g} s")

        async def one(spec: RequestSpec) -> RequestResult:
            if limit is None:
                return await timed(spec)
            async with limit:
                return await timed(spec)

        start = time.perf_counter()
        tasks = []
        for spec, offset in zip(specs, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def probe(base_url: str, model: str | None, spec: RequestSpec, endpoint: str, ignore_eos: bool,
                api_key: str | None) -> str:
    """Resolve the model name and send one request first (as vLLM's client does); a failure stops
    the benchmark with the server's error instead of a run of failed requests."""
    headers = auth_headers(api_key)
    async with make_client(base_url) as client:
        model = model or await first_model(client, headers)
        result = await send_request(client, endpoint_path(endpoint),
                                    build_payload(spec, model, endpoint, ignore_eos), spec.prompt_len, headers)
    if not result.success:
        raise RuntimeError(f"the first test request to {base_url} failed: {result.error}")
    return model


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0 or inf, got {text!r}")
    return rates


def load_specs(args: argparse.Namespace, count: int) -> list[RequestSpec]:
    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path to a local ShareGPT JSON file")
        return sharegpt_requests(args.dataset_path, tokenizer, count,
                                 output_len=args.output_len if args.output_len_set else None, seed=args.seed)
    return random_requests(tokenizer, count, args.input_len, args.output_len,
                           prefix_len=args.prefix_len, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="local ShareGPT JSON file")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder) for prompt lengths")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=None, help="default 128; for sharegpt, the replies'")
    p.add_argument("--prefix-len", type=int, default=0, help="random: tokens of one prefix shared by all")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", default="inf", help="requests/s, or inf to send all at once")
    p.add_argument("--sweep-rates", default=None, help="comma list, e.g. 1,2,4,8,inf (overrides --request-rate)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos + min_tokens = output length)")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--percentiles", default="90,99", help="besides mean and median")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--out-dir", default="bench/out/serve")
    p.add_argument("--label", default="serve", help="file name stem of the outputs")
    p.add_argument("--save-requests", action="store_true", help="keep per-request timings in the JSON")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    args.output_len_set = args.output_len is not None
    args.output_len = args.output_len or 128
    rates = parse_rates(args.sweep_rates or args.request_rate)
    percentiles = tuple(float(p) for p in args.percentiles.split(","))
    slos = parse_slos(args.goodput)
    # distinct prompts for the probe and for each rate, so no run is served from an earlier one's
    # prefix cache (beyond a shared --prefix-len, which is the point of that option)
    all_specs = load_specs(args, args.num_prompts * len(rates) + 1)
    model = asyncio.run(probe(args.base_url, args.model, all_specs[-1], args.endpoint, args.ignore_eos,
                              args.api_key))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m bench.serve " + shlex.join(sys.argv[1:] if argv is None else argv),
              "host": f"{platform.node()} {platform.machine()}", "base_url": args.base_url, "model": model,
              "dataset": args.dataset, "num_prompts": args.num_prompts, "burstiness": args.burstiness,
              "max_concurrency": args.max_concurrency, "goodput_slo_ms": slos or None, "runs": []}
    for i, rate in enumerate(rates):
        specs = all_specs[i * args.num_prompts:(i + 1) * args.num_prompts]
        print(f"rate {rate} req/s: sending {len(specs)} requests ...", flush=True)
        results, duration = asyncio.run(run_benchmark(
            specs, args.base_url, model, rate, args.burstiness, args.max_concurrency, args.endpoint,
            args.ignore_eos, args.seed, args.api_key, request_timeout_s=args.request_timeout))
        metrics = summarize(results, duration, percentiles, slos or None)
        run = {"request_rate": "inf" if np.isinf(rate) else rate, "metrics": metrics,
               "errors": sorted({(r.error or "?").splitlines()[0] for r in results if not r.success})[:10]}
        if args.save_requests:
            run["requests"] = [{k: v for k, v in asdict(r).items() if k != "generated_text"} for r in results]
        report["runs"].append(run)
        print(run_table(metrics), flush=True)
        for error in run["errors"]:
            print(f"  failed request: {error}", flush=True)
        if not args.no_plots:
            plot_cdfs(results, out_dir / f"{args.label}-cdf-rate-{run['request_rate']}.png",
                      f"{model} @ {run['request_rate']} req/s")
    write_outputs(report, out_dir, args.label, plots=not args.no_plots)
    return report


def write_outputs(report: dict, out_dir: Path, label: str, plots: bool = True) -> None:
    (out_dir / f"{label}.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Serving benchmark: {report['model']}", "",
             f"- date: {report['date']}", f"- command: `{report['command']}`", f"- host: {report['host']}",
             f"- server: {report['base_url']}, dataset {report['dataset']}, {report['num_prompts']} prompts, "
             f"burstiness {report['burstiness']}, max concurrency {report['max_concurrency']}", ""]
    if len(report["runs"]) > 1:
        lines += [sweep_table(report["runs"]), ""]
    for run in report["runs"]:
        lines += [f"## request rate {run['request_rate']}", "", run_table(run["metrics"]), ""]
    (out_dir / f"{label}.md").write_text("\n".join(lines))
    if plots and len(report["runs"]) > 1:
        plot_sweep(report["runs"], out_dir / f"{label}-sweep.png", f"{report['model']}: rate sweep")
    print(f"wrote {out_dir / label}.json and .md", flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, RuntimeError, OSError) as exc:  # bad arguments, data or server: say which
        sys.exit(f"error: {exc}")
