"""Arrival schedules and the metric definitions of `vllm bench serve`.

- Arrivals: gaps drawn from a gamma distribution with shape = burstiness and mean 1/rate
  (burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular, inf a fixed gap), summed, then
  scaled so the last request arrives at exactly num_requests / rate; rate inf sends everything at once.
- Per request: TTFT, ITL (every gap pooled over all requests), TPOT = (latency - TTFT) / (output
  tokens - 1) for requests with more than one output token, E2E latency.
- Throughputs divide by the wall time from the first arrival to the last response.
- Goodput: completed requests per second whose TTFT, TPOT and E2E latency all meet the SLOs given
  (a request with one output token has TPOT 0 here).
"""
from __future__ import annotations

import math

import numpy as np

from bench.common import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")


def arrival_offsets(num_requests: int, rate: float, burstiness: float = 1.0,
                    rng: np.random.Generator | None = None) -> list[float]:
    """Send time of each request in seconds after the first."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / rate)
    else:
        rng = rng or np.random.default_rng(0)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    offsets *= (num_requests / rate) / offsets[-1]
    return offsets.tolist()


def tpot(result: RequestResult) -> float:
    """Mean time per output token after the first; 0 for a single-token response."""
    if result.output_tokens <= 1:
        return 0.0
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    values = np.asarray(values_s or [0.0]) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(values)), f"median_{name}_ms": float(np.median(values)),
           f"std_{name}_ms": float(np.std(values))}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(values, p))
    return out


def _peaks(done: list[RequestResult]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket, and peak number of requests in flight."""
    if not done:
        return 0.0, 0
    t0 = min(r.start_time for r in done)
    buckets: dict[int, int] = {}
    for r in done:
        t = r.start_time + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return float(max(buckets.values())), peak


def summarize(results: list[RequestResult], duration_s: float,
              percentiles: tuple[float, ...] = (50, 90, 99),
              slo_ms: dict[str, float] | None = None) -> dict:
    """The metrics of one benchmark run as a flat dict (keys as in vLLM's result JSON)."""
    if duration_s <= 0:
        raise ValueError("duration must be > 0")
    for key in slo_ms or {}:
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"unknown SLO metric {key!r}: use ttft, tpot or e2el")
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    good = 0
    for r in done:
        measured = {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}
        if slo_ms and all(measured[k] * 1000.0 <= v for k, v in slo_ms.items()):
            good += 1
    peak_tok_s, peak_concurrency = _peaks(done)
    out = {
        "duration": duration_s, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if slo_ms else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_tok_s, "max_concurrent_requests": peak_concurrency,
    }
    per_metric = {"ttft": [r.ttft for r in done], "tpot": [tpot(r) for r in done if r.output_tokens > 1],
                  "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done]}
    for name in METRICS:
        out.update(_stats(name, per_metric[name], percentiles))
    return out


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes metric:ms pairs with metric ttft, tpot or e2el; got {item!r}")
        slos[name] = float(value)
    return slos
