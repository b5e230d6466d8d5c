"""Where an eager prefill / mixed step's time goes on the GPU: Qwen3-4B (real shapes, random bf16 weights
through the real loader) run as the server runs it under load, e.g. 8 × 1024-token prompts (8192 tokens,
vLLM's default step) or 7 prompts plus 200 decode rows.

Per scenario: the step's wall time (execute(): launch + forward + sampling, synchronized; median of
--reps after a warm-up), the host's launch time (submit up to the last launch), and one step's ops timed
with CUDA events (bench/op_timer.py): per op its GPU ms, share of the step and, for the products, TFLOP/s
against cuBLAS's measured ~800. The sum of the ops' times against the step's GPU span shows how much of
it is launch gaps (the GPU waiting on Python).

    python3 bench/mixed_step.py --out DIR [--model qwen3-4b] [--scenarios 8x1024,7x1024+200d,1x1024] [--reps 3]
A scenario is P x L (P prompts of L tokens) with an optional @S (the L tokens follow a cached prefix of S:
a chunk, or a prefix hit's recomputed tokens, e.g. 1x16@16384) and +Dd (D decode rows at context --context).
Writes DIR/mixed_step.json and DIR/mixed_step.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
CUBLAS_TFLOPS = 800.0       # cuBLAS bf16 on the H200 (the brief's measured 790-820)


def parse_scenario(text: str) -> tuple[int, int, int, int]:
    """'8x1024' -> (8, 1024, 0, 0); '7x1024+200d' -> (7, 1024, 200, 0); '1x16@16384' -> (1, 16, 0, 16384)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+))?(?:\+(\d+)d)?", text)
    if not m:
        raise SystemExit(f"bad scenario {text!r}: expected PxL[@S][+Dd]")
    return int(m[1]), int(m[2]), int(m[4] or 0), int(m[3] or 0)


def build_step(prompts: int, length: int, decodes: int, context: int, vocab: int, seed: int = 0,
               prefix: int = 0) -> ModelBatch:
    """The step's rows: decodes first (as the scheduler puts them), each on its own blocks."""
    rng = np.random.default_rng(seed)
    seqs, next_block = [], 0

    def blocks(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-n_tokens // BLOCK_SIZE)
        next_block += n
        return list(range(next_block - n, next_block))

    for j in range(decodes):
        seqs.append(SeqStep(seq_id=j, token_ids=[int(rng.integers(0, vocab))], start_pos=context,
                            block_table=blocks(context + 1), sample=True, params=GREEDY, prompt_len=context))
    for j in range(prompts):
        seqs.append(SeqStep(seq_id=decodes + j, token_ids=rng.integers(0, vocab, length).tolist(), start_pos=prefix,
                            block_table=blocks(prefix + length), sample=True, params=GREEDY,
                            prompt_len=prefix + length))
    return ModelBatch.build(seqs)


def blocks_needed(prompts: int, length: int, decodes: int, context: int, prefix: int = 0) -> int:
    return prompts * -(-(prefix + length) // BLOCK_SIZE) + decodes * -(-(context + 1) // BLOCK_SIZE)


def random_executor(name: str, scenarios: list[tuple[int, int, int, int]], context: int):
    """(model, GpuExecutor) of bench/configs/<name> with random bf16 weights (written once to
    /tmp/<name>-random), sized for the scenarios' steps and the decode rows' context."""
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from harness.models import write_random_qwen3

    folder = f"/tmp/{name}-random"
    write_random_qwen3(os.path.join(ROOT, "bench", "configs", name, "config.json"), folder)
    import torch
    torch.cuda.empty_cache()                            # the HF copy's memory back before ours is sized
    model = load_model(folder)
    ex = GpuExecutor(model, options_of(
        num_kv_blocks=max(blocks_needed(p, n, d, context, s) for p, n, d, s in scenarios) + 16,
        max_model_len=max(context + 16, max(s + n for _, n, _, s in scenarios)),
        max_num_batched_tokens=max(256, max(p * n + d for p, n, d, _ in scenarios)), max_num_seqs=256, progress=False))
    return model, ex


def time_scenario(ex, batch: ModelBatch, reps: int) -> dict:
    """Wall and launch ms (medians), one step's ops (bench/op_timer.py) and the GPU span of a step."""
    import cupy

    from bench.op_timer import time_ops

    ex.execute(batch)                                   # warm-up: kernel compiles, module loads
    wall, launch = [], []
    for _ in range(reps):
        t = time.perf_counter()
        ex.execute(batch)
        wall.append(time.perf_counter() - t)
        launch.append(ex.last_host_s)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    ex.stream.synchronize()
    e0.record(ex.stream)
    ex.execute(batch)
    e1.record(ex.stream)
    e1.synchronize()
    span = cupy.cuda.get_elapsed_time(e0, e1)
    rows = time_ops(ex, lambda: ex.execute(batch))
    return {"wall_ms": float(np.median(wall) * 1e3), "launch_ms": float(np.median(launch) * 1e3), "gpu_span_ms": span,
            "ops": [{"op": r.op, "depth": r.depth, "calls": r.calls, "ms": r.ms,
                     "tflops": r.flops / r.ms / 1e9 if r.flops else None} for r in rows]}


def report(results: list[dict]) -> str:
    lines = []
    for res in results:
        top = [o for o in res["ops"] if o["depth"] == 0]
        ops_ms = sum(o["ms"] for o in top)
        gemm_ms = sum(o["ms"] for o in top if o["tflops"])
        lines += [f"### {res['scenario']}: {res['prefill_tokens']} prompt tokens + {res['decode_rows']} decode rows", "",
                  f"wall {res['wall_ms']:.2f} ms (launch {res['launch_ms']:.2f} ms), GPU span {res['gpu_span_ms']:.2f} ms, "
                  f"timed ops {ops_ms:.2f} ms; {res['tokens'] / res['wall_ms'] * 1e3:,.0f} tokens/s; "
                  f"{res['tflops_step']:.0f} TFLOP/s over the wall (model FLOPs {res['gflop_per_token']:.1f} GFLOP/token)", "",
                  "| op | depth | calls | GPU ms | share of timed | TFLOP/s | of cuBLAS |", "|---|---|---|---|---|---|---|"]
        for o in sorted(res["ops"], key=lambda o: (o["depth"], -o["ms"])):
            tf = f"{o['tflops']:.0f}" if o["tflops"] else "-"
            frac = f"{o['tflops'] / CUBLAS_TFLOPS:.2f}" if o["tflops"] else "-"
            lines.append(f"| {o['op']} | {o['depth']} | {o['calls']} | {o['ms']:.2f} | {o['ms'] / ops_ms:.3f} | {tf} | {frac} |")
        lines += ["", f"top-level ops with a product (their fused norms / adds included): {gemm_ms:.2f} ms of {ops_ms:.2f}", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--scenarios", default="8x1024,7x1024+200d,1x1024")
    p.add_argument("--context", type=int, default=1100, help="decode rows' context length")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    scenarios = [parse_scenario(s) for s in a.scenarios.split(",")]
    model, ex = random_executor(a.model, scenarios, a.context)
    cfg = model.config
    # per token: 2 FLOPs per weight of the layers (embedding and LM head left out; attention not counted)
    gflop = 2 * sum(int(w.size) for k, w in model.weights.items() if k not in ("embed_tokens", "lm_head")) / 1e9
    results = []
    for (n_prompts, length, decodes, prefix), name in zip(scenarios, a.scenarios.split(",")):
        batch = build_step(n_prompts, length, decodes, a.context, cfg.vocab_size - 1000, prefix=prefix)
        r = time_scenario(ex, batch, a.reps)
        n_tok = n_prompts * length + decodes
        r.update(scenario=name, prefill_tokens=n_prompts * length, decode_rows=decodes, tokens=n_tok,
                 gflop_per_token=gflop, tflops_step=gflop * n_tok / r["wall_ms"])
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "ops"}), flush=True)
    ex.close()
    with open(os.path.join(a.out, "mixed_step.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report(results)
    with open(os.path.join(a.out, "mixed_step.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
