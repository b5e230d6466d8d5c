"""The numpy executor's step cost, measured: CPU time (one BLAS thread, best of --reps) of one step of a
model (default: the demo model) feeding a chunk of n tokens after s computed ones, beside d decodes at
context c; the KV blocks scattered over the pool as a server's are. engine/executor/cpu_cost.py's
constants come from these (a token: the slope in n at s = 0; a key: the slope in s or c; a pair: the
slope in n at a large s, less a token).

    python -m bench.cpu_step_cost 2,0,0,0 64,0,0,0 2,8000,0,0 32,8000,0,0 0,0,1,16 0,0,1,8000
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
from memory.kv_pool import blocks_for  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", nargs="+", metavar="n,s,d,c", help="chunk tokens, tokens before it, decodes, their context")
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
    order = [int(b) for b in np.random.default_rng(1).permutation(pool)]
    rng = np.random.default_rng(0)
    for n, s, d, c in specs:
        steps = [SeqStep(0, rng.integers(100, 1000, n).tolist(), s, order[:per_seq], True)] if n else []
        at = per_seq
        for i in range(d):
            steps.append(SeqStep(i + 1, [5], c, order[at:at + blocks_for(c + 1)], True))
            at += blocks_for(c + 1)
        batch, best = ModelBatch.build(steps), float("inf")
        for _ in range(args.reps):
            t = time.process_time()
            ex.execute(batch)
            best = min(best, time.process_time() - t)
        print(f"n={n} s={s} d={d} c={c}: {best * 1e3:.1f} ms CPU", flush=True)


if __name__ == "__main__":
    main()
