"""The numpy executor's step cost, measured: CPU time (one BLAS thread, --reps repeats) of one step of a
model (default: the demo model) feeding a chunk of n tokens after s computed ones, beside d decodes at
context c; the KV blocks scattered over the pool as a server's are. Each step is printed beside its time
under the model (engine/executor/cpu_cost.py). --products ROWS times the model's linear layers alone at
each number of rows (the decoder layers' products, and the lm_head's) and fits cpu_cost.py's terms:
a matrix-vector product's read of the weights at one row; a matrix product's read and a row's
multiply-adds from two rows on.

    python -m bench.cpu_step_cost 2,0,0,0 64,0,0,0 2,8000,0,0 32,8000,0,0 0,0,1,16 0,0,1,8000
    python -m bench.cpu_step_cost --products 1,2,3,4,6,8,12,16,24,32,48,64,80,96 --reps 9
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from engine.batch import ModelBatch, SeqStep  # noqa: E402
from engine.executor.cpu import CpuExecutor  # noqa: E402
from engine.executor.options import options_of  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.models.decoder import lm_head_weight  # noqa: E402
from engine.step_budget import StepBudget  # noqa: E402
from memory.kv_pool import blocks_for  # noqa: E402


def cpu_times(run, reps: int, *args) -> np.ndarray:
    """CPU seconds of `reps` calls of run(*args)."""
    out = []
    for _ in range(reps):
        t = time.process_time()
        run(*args)
        out.append(time.process_time() - t)
    return np.array(out)


def modelled(ex: CpuExecutor, n: int, s: int, d: int, c: int) -> float:
    """The step's seconds under the executor's cost model."""
    budget = StepBudget.of(ex.options.max_num_batched_tokens, ex.step_cost)
    for _ in range(d):
        budget.spend(c, 1, prefill=False)
    if n:
        budget.spend(s, n, prefill=True)
    return budget.time()


def steps(ex: CpuExecutor, specs: list[tuple[int, int, int, int]], per_seq: int, pool: int, reps: int) -> None:
    order = [int(b) for b in np.random.default_rng(1).permutation(pool)]
    rng = np.random.default_rng(0)
    for n, s, d, c in specs:
        seqs = [SeqStep(0, rng.integers(100, 1000, n).tolist(), s, order[:per_seq], True)] if n else []
        at = per_seq
        for i in range(d):
            seqs.append(SeqStep(i + 1, [5], c, order[at:at + blocks_for(c + 1)], True))
            at += blocks_for(c + 1)
        batch = ModelBatch.build(seqs)
        t = cpu_times(ex.execute, reps, batch) * 1e3
        print(f"n={n} s={s} d={d} c={c}: {t.min():.1f} ms CPU best, {np.median(t):.1f} median "
              f"(model {modelled(ex, n, s, d, c) * 1e3:.1f})", flush=True)


def fit(rows: list[int], seconds: list[float]) -> tuple[float, float, float]:
    """(one, many, row): the time at one row; a least-squares line many + rows * row over the rest."""
    at = {r: t for r, t in zip(rows, seconds)}
    more = [r for r in rows if r > 1]
    row, many = np.polyfit(more, [at[r] for r in more], 1) if len(more) > 1 else (0.0, at.get(more[0], 0.0))
    return at.get(1, 0.0), float(many), float(row)


def linear_layers(ex: CpuExecutor, xs: dict[int, np.ndarray], mats: list[np.ndarray]) -> None:
    for w in mats:
        ex.ops.linear(xs[w.shape[1]], w)


def products(ex: CpuExecutor, rows: list[int], reps: int) -> None:
    """Each row count's CPU time of the decoder layers' products and of the lm_head's (median, p90), and
    the terms fitted to the medians."""
    layers = [w for name, w in ex.weights.items() if name.startswith("layers.") and w.ndim == 2]
    parts = {"layers": layers, "lm_head": [lm_head_weight(ex.config, ex.weights)]}
    rng, medians = np.random.default_rng(0), {k: [] for k in parts}
    ex.threads.for_step(1)
    for r in rows:
        line = [f"rows={r}:"]
        for name, mats in parts.items():
            xs = {w.shape[1]: rng.standard_normal((r, w.shape[1]), dtype=np.float32) for w in mats}
            t = cpu_times(linear_layers, reps, ex, xs, mats) * 1e3
            medians[name].append(float(np.median(t)) / 1e3)
            line.append(f"{name} median {np.median(t):.1f} ms, p90 {np.percentile(t, 90):.1f}")
        print(" ".join(line), flush=True)
    for name, mats in parts.items():
        one, many, row = fit(rows, medians[name])
        size, macs = sum(w.size * 4 for w in mats), sum(w.size for w in mats)
        print(f"{name}: one row {one * 1e3:.1f} ms ({size / one / 1e9:.1f} GB/s); from two rows {many * 1e3:.1f} ms "
              f"({size / many / 1e9:.1f} GB/s) + {row * 1e3:.2f} ms a row ({macs / row / 1e9:.1f} G multiply-adds/s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", nargs="*", metavar="n,s,d,c", help="chunk tokens, tokens before it, decodes, their context")
    p.add_argument("--products", default=None, metavar="ROWS", help="comma-separated row counts: time the "
                   "linear layers alone")
    p.add_argument("--model", default=None, help="an HF folder or .gguf (default: the demo model)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    specs = [tuple(map(int, spec.split(","))) for spec in args.steps]
    if args.model is None:
        from engine.loader.demo import demo_model_path
        args.model = demo_model_path()
    per_seq = blocks_for(args.max_model_len)
    pool = per_seq + sum(d * blocks_for(c + 1) for _, _, d, c in specs) + 1
    ex = CpuExecutor(load_model(args.model), options_of(max_model_len=args.max_model_len, num_kv_blocks=pool,
                                                        max_num_batched_tokens=args.max_model_len, cpu_threads=1))
    if args.products:
        products(ex, [int(r) for r in args.products.split(",")], args.reps)
    steps(ex, specs, per_seq, pool, args.reps)


if __name__ == "__main__":
    main()
