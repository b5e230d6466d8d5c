"""Decode-step time with sampling inside the CUDA graph vs the eager GPU sampler after the graph.

    python3 bench/graph_sampling.py --batches 1,32 --steps 200

A tiny Qwen3 (2 layers, the real 151,936-token vocabulary) keeps the forward small, so the numbers
show what sampling adds to a step. Per batch size and sampling setting, one decode step (the same
tokens and positions every time) is submitted and waited for `steps` times; reported: the mean
wall time per step (submit + result) and the host time up to the launch (executor.last_host_s;
the eager path's sampling host work comes after it), with the host pieces of a graph step printed.
"graph": sampling captured in the decode graph (GraphStep); "eager": the greedy graph, then the
sampler's kernels launched eagerly and synced (bench/ab_switches.py: graphs.sample_in_graph = False). Then the
argmax + logsumexp of S rows alone (CUDA events): one CTA per row vs ARGMAX_CHUNKS CTAs per row.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k+top_p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "top_p+logprobs5": dict(temperature=0.8, top_p=0.95, logprobs=5),
}


PARTS = (("executor", "_context"), ("sampler", "fill_graph_rows"), ("graphs", "_replay"), ("graphs", "_copy_back"))


def timed_parts(ex) -> dict[str, float]:
    """Wrap the host-side pieces of a graph step (batch upload, parameter block, replay, copies back)
    with accumulating timers; returns the accumulator (seconds)."""
    acc = {name: 0.0 for _, name in PARTS}
    owners = {"executor": ex, "sampler": ex.sampler, "graphs": ex.graphs}
    for owner, name in PARTS:
        obj = owners[owner]
        fn = getattr(obj, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_name] += time.perf_counter() - t
        setattr(obj, name, wrapped)
    return acc


def time_steps(ex, batch, steps: int, acc: dict[str, float]) -> tuple[float, float, dict[str, float]]:
    for _ in range(5):
        ex.submit(batch).result()
    for k in acc:
        acc[k] = 0.0
    host, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        ex.submit(batch).result()
        host += ex.last_host_s
    parts = {k: v / steps * 1e3 for k, v in acc.items()}
    return (time.perf_counter() - t0) / steps * 1e3, host / steps * 1e3, parts


def step_rows(batches: list[int], steps: int) -> list[tuple]:
    from engine.loader import load_model
    from bench.ab_switches import ABGpuExecutor
    from engine.request import SamplingParams
    from harness.executors import Decoder, new_gpu_executor
    from harness.models import random_sequences, tiny_model_path

    model = load_model(tiny_model_path("qwen3_gqa4"))
    B = max(batches)
    ex = new_gpu_executor(model, ABGpuExecutor, max_num_seqs=B, num_kv_blocks=4 * B + 16)
    acc, rows = timed_parts(ex), []
    for n in batches:
        dec = Decoder(ex, random_sequences(model.config.vocab_size, [12] * n, seed=n), steps=1)
        for name, kw in SETTINGS.items():
            batch = dec.batch([SamplingParams(**kw, seed=i) for i in range(n)])
            for mode in (("graph",) if name == "greedy" else ("graph", "eager")):
                ex.graphs.sample_in_graph = mode == "graph"
                ms, host, parts = time_steps(ex, batch, steps, acc)
                rows.append((n, name, mode, ms, host))
                print(f"batch {n:3d} {name:16s} {mode:5s} {ms:7.3f} ms/step  host {host:6.3f} ms  (ms/step: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + ")", flush=True)
    ex.graphs.sample_in_graph = True
    ex.close()
    return rows


def argmax_rows(counts: list[int], reps: int = 200) -> list[tuple]:
    import cupy

    from engine.executor.gpu_sampler import GpuSampler
    from memory.device_arena import DeviceArena

    V = 151936
    arena = DeviceArena(1 << 30)
    stream = cupy.cuda.Stream(non_blocking=True)
    sampler = GpuSampler(arena, max(counts), V, stream)
    logits = arena.take("bench.logits", (max(counts), V), np.float32)
    logits.set(np.random.default_rng(0).standard_normal((max(counts), V), np.float32), stream=stream)
    null, out = np.uint64(0), []

    def single(S):
        sampler.k_argmax((S,), (1024,), (logits, np.int32(V), null, sampler.ids, null, sampler.lse), stream=stream)

    for S in counts:
        times = {}
        for name, fn in (("one CTA per row", single), ("split", lambda S: sampler.argmax(logits, S))):
            for _ in range(10):
                fn(S)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(reps):
                fn(S)
            end.record(stream)
            end.synchronize()
            times[name] = cupy.cuda.get_elapsed_time(start, end) / reps * 1e3
        out.append((S, times["one CTA per row"], times["split"]))
        print(f"argmax S={S}: one CTA/row {times['one CTA per row']:.2f} us, split {times['split']:.2f} us", flush=True)
    arena.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--argmax-rows", default="1,4,16,32")
    args = ap.parse_args()
    steps = step_rows([int(b) for b in args.batches.split(",")], args.steps)
    arg = argmax_rows([int(s) for s in args.argmax_rows.split(",")])
    lines = ["| batch | sampling | path | ms/step | host ms/step |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {name} | {mode} | {ms:.3f} | {host:.3f} |" for n, name, mode, ms, host in steps]
    lines += ["", "| rows | argmax one CTA/row µs | argmax split µs |", "|---|---|---|"]
    lines += [f"| {S} | {a:.2f} | {b:.2f} |" for S, a, b in arg]
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "graph_sampling.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
