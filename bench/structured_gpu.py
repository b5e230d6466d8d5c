"""What structured output costs a GPU decode step: Qwen3-4B (real shape, random bf16 weights through our
loader, the real Qwen tokenizer), 32 requests decoding together, k of them under a JSON schema, k = 0, 8, 32.

Each run is a fresh in-process engine with a step trace; the figure is the median wall time of the decode
steps that carry all 32 rows (every row past its prefill, none finished; where the prompts did not fit
one step, the widest decode steps), next to the same steps' GPU time.
The masks are filled on the host for step N+1 while step N's graph runs and applied by the mask_logits
kernel, so their cost is what the wall adds over 0 constrained rows.

    python3 bench/structured_gpu.py --out OUT          (on the GPU host, after `source bench/gpu_env.sh`)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.step_profile import load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, PROMPT, TOKENS = 32, 128, 96
# A schema whose string keeps every constrained row under the grammar for all TOKENS steps.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 600},
                                           "n": {"type": "integer"}},
          "required": ["text", "n"], "additionalProperties": False}


def run(folder: str, constrained: int, trace: str, device: str = "cuda") -> dict:
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    from engine.request import GenerateRequest, SamplingParams
    from server.structured import json_grammar

    if os.path.exists(trace):
        os.remove(trace)
    rng = np.random.default_rng(constrained)
    free = SamplingParams(temperature=0.8, max_tokens=TOKENS, ignore_eos=True, seed=1)
    constrained_params = dataclasses.replace(free, grammar=json_grammar(SCHEMA, "schema"))
    with EngineHandle(EngineConfig(model=folder, device=device, max_model_len=512, step_trace=trace,
                                   progress=False)) as handle:
        handle.generate([[1, 2, 3]], SamplingParams(max_tokens=4))          # warm: graphs, kernels
        t0 = time.perf_counter()
        sinks = []
        for i in range(BATCH):
            ids = rng.integers(100, 100000, PROMPT).tolist()
            req = GenerateRequest(f"r{i}", ids, constrained_params if i < constrained else free)
            q: list = []
            handle.engine.add_request(req, q.append)
            sinks.append(q)
        while not all(q and q[-1] is None for q in sinks):
            time.sleep(0.01)
        wall_s = time.perf_counter() - t0
    trace_rows = load(trace)
    widest = max(r["decode"] for r in trace_rows if not r["prefill"])        # BATCH where the prompts fit one step
    walls, gpu = [], []
    for a, b in zip(trace_rows, trace_rows[1:]):                               # a step's wall: to the next start
        if not a["prefill"] and a["decode"] == widest:
            walls.append((b["t"] - a["t"]) * 1e3)
            gpu.append(a["gpu_ms"] or 0.0)
    rows = [r for r in trace_rows if not r["prefill"] and r["decode"] == widest]
    return {"constrained": constrained, "decode_rows": widest, "full_decode_steps": len(walls),
            "step_wall_ms_median": statistics.median(walls) if walls else None,
            "step_gpu_ms_median": statistics.median(gpu) if gpu else None,
            "graphed_share": sum(bool(r["graphed"]) for r in rows) / max(1, len(rows)), "run_s": wall_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="0,8,32")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script on a small --folder model")
    p.add_argument("--folder", default=None, help="this model folder instead of random Qwen3-4B weights")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    folder = a.folder
    if folder is None:
        from harness.models import write_random_qwen3

        folder = "/tmp/qwen3-4b-random"
        write_random_qwen3(os.path.join(ROOT, "bench", "configs", "qwen3-4b", "config.json"), folder)
    results = []
    for k in (int(x) for x in a.rows.split(",")):
        results.append(run(folder, k, os.path.join(a.out, f"steps-{k}.jsonl"), a.device))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["step_wall_ms_median"]
    lines = ["| constrained rows of 32 | decode steps (widest) | step wall ms (median) | GPU ms (median) | "
             "graphed | over 0 rows |", "|---|---|---|---|---|---|"]
    for r in results:
        over = f"{r['step_wall_ms_median'] / base - 1:+.1%}" if base and r["step_wall_ms_median"] else "-"
        lines.append(f"| {r['constrained']} | {r['full_decode_steps']} of {r['decode_rows']} rows | {r['step_wall_ms_median']:.3f} | "
                     f"{r['step_gpu_ms_median']:.3f} | {r['graphed_share']:.2f} | {over} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "structured_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(a.out, "structured_gpu.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
