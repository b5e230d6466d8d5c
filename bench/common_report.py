"""Benchmark output: a markdown summary and PNG plots (matplotlib is optional; without it, no plots)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.common import RequestResult
from bench.common_metrics import tpot

SUMMARY_ROWS = [
    ("Successful requests", "completed", "{:d}"), ("Failed requests", "failed", "{:d}"),
    ("Benchmark duration (s)", "duration", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.3f}"),
    ("Request goodput (req/s)", "request_goodput", "{:.3f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Peak output token throughput (tok/s)", "max_output_tokens_per_s", "{:.2f}"),
    ("Peak concurrent requests", "max_concurrent_requests", "{:d}"),
]
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None else pattern.format(value)


def run_table(metrics: dict) -> str:
    """One run: the totals, then mean / median / percentiles of each latency metric in ms."""
    lines = ["| metric | value |", "| --- | --- |"]
    lines += [f"| {label} | {_fmt(metrics.get(key), pattern)} |" for label, key, pattern in SUMMARY_ROWS]
    stats = [k.split("_")[0] for k in metrics if k.endswith("_ttft_ms") and k.split("_")[0] != "std"]
    lines += ["", "| latency (ms) | " + " | ".join(stats) + " |", "| --- |" + " --- |" * len(stats)]
    for name, label in LATENCY_NAMES.items():
        lines.append(f"| {label} | " + " | ".join(f"{metrics[f'{s}_{name}_ms']:.2f}" for s in stats) + " |")
    return "\n".join(lines)


def sweep_table(runs: list[dict]) -> str:
    """One row per request rate."""
    lines = ["| rate (req/s) | done | req/s | out tok/s | TTFT mean/p99 (ms) | TPOT mean/p99 (ms) "
             "| ITL mean/p99 (ms) | E2E mean/p99 (ms) |", "| --- " * 8 + "|"]
    for run in runs:
        m = run["metrics"]
        cells = [f"{m[f'mean_{n}_ms']:.1f} / {m.get(f'p99_{n}_ms', float('nan')):.1f}"
                 for n in ("ttft", "tpot", "itl", "e2el")]
        lines.append(f"| {run['request_rate']} | {m['completed']} | {m['request_throughput']:.3f} "
                     f"| {m['output_throughput']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_cdfs(results: list[RequestResult], path: Path, title: str) -> Path | None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E latency; None when matplotlib is absent."""
    plt = pyplot()
    done = [r for r in results if r.success]
    if plt is None or not done:
        return None
    series = {"TTFT": [r.ttft for r in done], "TPOT": [tpot(r) for r in done if r.output_tokens > 1],
              "ITL": [g for r in done for g in r.itl], "E2E latency": [r.latency for r in done]}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, series.items()):
        if values:
            ms = np.sort(np.asarray(values) * 1000.0)
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(runs: list[dict], path: Path, title: str) -> Path | None:
    """Throughput, TTFT and TPOT against the offered request rate (inf drawn one step past the last)."""
    plt = pyplot()
    if plt is None or not runs:
        return None
    finite = [float(r["request_rate"]) for r in runs if r["request_rate"] != "inf"]
    x = [float(r["request_rate"]) if r["request_rate"] != "inf" else (max(finite, default=1.0) * 2)
         for r in runs]
    labels = [str(r["request_rate"]) for r in runs]
    panels = [("output tok/s", ["output_throughput"]), ("TTFT (ms)", ["mean_ttft_ms", "p99_ttft_ms"]),
              ("TPOT (ms)", ["mean_tpot_ms", "p99_tpot_ms"])]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, (ylabel, keys) in zip(axes, panels):
        for key in keys:
            ax.plot(x, [r["metrics"].get(key, np.nan) for r in runs], marker="o", label=key)
        ax.set_xscale("log")
        ax.set_xticks(x, labels)
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
