"""Prometheus text exposition: request latency histograms and token counters the server measures,
plus gauges read from the engine's stats() (running / waiting requests, KV usage, prefix-cache hits) and,
with speculative decoding on, vLLM's spec_decode_* counters.

With several engines (--data-parallel-size) each engine gauge has the engines' total (no label, what one
engine reports) and each engine's value under the label engine="<rank>" (vLLM's label), and
openinfer_data_parallel_requests_total{engine="<rank>"} counts the requests sent to each: a sum over a gauge's
series must select one kind, e.g. sum(openinfer_num_requests_running{engine!=""})."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.stats import EngineStats

PREFIX = "openinfer_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = PREFIX + name, help_text, buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{upper}"}} {c}' for upper, c in zip(self.buckets, self.counts)]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}',
                  f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class Counter:
    def __init__(self, name: str, help_text: str):
        self.name, self.help, self.value = PREFIX + name, help_text, 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter", f"{self.name} {self.value}"]


def gauge(name: str, help_text: str, samples: list[tuple[str, float]], kind: str = "gauge") -> list[str]:
    """One metric family: (labels, value) samples, labels as written between braces ("" for none)."""
    name = PREFIX + name
    return ([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            + [f"{name}{{{labels}}} {float(v)}" if labels else f"{name} {float(v)}" for labels, v in samples])


# Engine stats under fixed names (stat -> metric, help); any other numeric field is exported as
# `openinfer_engine_<field>`.
ENGINE_GAUGES = {
    "num_running": ("num_requests_running", "Sequences running in the engine."),
    "num_waiting": ("num_requests_waiting", "Sequences waiting to be scheduled."),
    "kv_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)."),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Fraction of looked-up prompt tokens found in the "
                              "prefix cache."),
}


# Speculative decoding's counters (EngineStats field -> help), vLLM's names and helps, exported as counters.
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}


class ServerMetrics:
    """Everything /metrics reports; `observe_request` is called once per finished engine request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.")
        self.cached_tokens = Counter("prompt_tokens_cached_total", "Prompt tokens served from the prefix cache.")
        self.requests = Counter("request_success_total", "Engine requests finished.")
        self.request_errors = Counter("request_failure_total", "Engine requests that ended in an error, "
                                      "rejection or abort.")

    def observe_request(self, *, ok: bool, prompt_tokens: int, generated: int, cached: int,
                        ttft: float | None, e2e: float, decode_time: float | None) -> None:
        with self.lock:
            (self.requests if ok else self.request_errors).inc()
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(generated)
            self.cached_tokens.inc(cached)
            if ttft is not None:
                self.ttft.observe(ttft)
            self.e2e.observe(e2e)
            if decode_time is not None and generated > 1:
                self.tpot.observe(decode_time / (generated - 1))

    def render(self, stats: EngineStats | None = None, replicas: list[EngineStats] | None = None,
               dispatched: list[int] | None = None) -> str:
        """replicas / dispatched: with several engines, each one's stats and the requests sent to each."""
        lines = []
        with self.lock:
            for metric in (self.prompt_tokens, self.generation_tokens, self.cached_tokens, self.requests,
                           self.request_errors, self.ttft, self.tpot, self.e2e):
                lines += metric.render()
        lines += engine_gauges(stats, replicas or []) + spec_decode_counters(stats) + lora_info(stats)
        if dispatched:
            lines += gauge("data_parallel_requests_total", "Engine requests sent to each data-parallel engine.",
                           [(f'engine="{rank}"', n) for rank, n in enumerate(dispatched)], kind="counter")
        return "\n".join(lines) + "\n"


def engine_gauges(stats: EngineStats | None, replicas: list[EngineStats] | None = None) -> list[str]:
    """Every numeric field (and the derived figures) of the engine's stats as a gauge; with replicas, each
    one's value too, labelled engine="<rank>"."""
    if stats is None:
        return []
    each = [s.by_name() for s in replicas or []]
    lines = []
    for key, value in stats.by_name().items():
        if key in SPEC_DECODE_COUNTERS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name, help_text = ENGINE_GAUGES.get(key, (f"engine_{key}", f"Engine statistic {key}."))
        samples = [("", value)] + [(f'engine="{rank}"', values[key]) for rank, values in enumerate(each)]
        lines += gauge(name, help_text, samples)
    return lines


def spec_decode_counters(stats: EngineStats | None) -> list[str]:
    """vLLM's spec_decode_* counters, the accepted tokens per draft position labelled `position`; nothing
    while speculative decoding is off."""
    if stats is None or not stats.spec_decode_accepted_per_pos:
        return []
    per_pos, values, lines = stats.spec_decode_accepted_per_pos, stats.by_name(), []
    for key, help_text in SPEC_DECODE_COUNTERS.items():
        name = f"{PREFIX}{key}_total"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {values[key]}"]
    name = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {name} Accepted tokens per draft position.", f"# TYPE {name} counter"]
    return lines + [f'{name}{{position="{pos}"}} {n}' for pos, n in enumerate(per_pos)]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def lora_info(stats: EngineStats | None) -> list[str]:
    """vLLM's lora_requests_info: labels max_lora and the running / waiting adapters' names (comma-separated),
    the value the time of the report; nothing when the engine serves no LoRA adapters."""
    if stats is None or not stats.lora_max_adapters:
        return []
    name = PREFIX + "lora_requests_info"
    labels = (f'running_lora_adapters="{_label(stats.lora_running_adapters)}",max_lora="{stats.lora_max_adapters}",'
              f'waiting_lora_adapters="{_label(stats.lora_waiting_adapters)}"')
    return [f"# HELP {name} Running stats on LoRA requests.", f"# TYPE {name} gauge",
            f"{name}{{{labels}}} {time.time()}"]
