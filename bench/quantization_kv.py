"""--kv-cache-dtype fp8 against bf16 KV on Qwen3-8B (real shapes, random bf16 weights written as safetensors and
loaded through the real loader, as bench/decode.py does): issue 55's two figures, each with the bf16 figure of
the same run beside it.

1. KV blocks at the same memory: the GPU executor sized from --gpu-memory-utilization (num_kv_blocks unset),
   once per KV dtype; target 2.0x.
2. Batch-128 decode at 4k context: --batch sequences of --context - --steps prompt tokens (prefilled, chunked to
   the token budget), then --steps CUDA-graph decode steps (so the context runs up to --context); the median
   step (wall), the step less its host part, the captured graph replayed back to back, and the HBM roofline
   (weights + the KV bytes a step reads at the mean context, 2 or 1 bytes a value); target fp8 >= 1.3x faster.
   At full depth the bf16 pool of 128 x 4k tokens is ~77 GB (36 layers x 2 x 8 heads x 128 x 2 bytes a token):
   an H200 holds it beside the 16 GB of weights, an H100 does not: there, --layers 18 runs the first 18 layers
   (the ratio is per layer; the report says which ran).

    python3 bench/quantization_kv.py --out bench/results [--layers N] [--batch 128] [--context 4096] [--steps 64]
Writes OUT/STEM.json and OUT/STEM.md (date, GPU, command, both figures); STEM quantization-kv for Qwen3-8B,
quantization-kv-MODEL for another model (--stem to choose).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode import config_path, copy_bandwidth, random_weights_folder, run_batch  # noqa: E402
from engine.batch import BLOCK_SIZE  # noqa: E402

DTYPES = ("bfloat16", "fp8")


def pool_blocks_at(model, kv_cache_dtype: str, utilization: float) -> dict:
    """The KV pool the executor sizes from the memory budget for this KV dtype."""
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of

    ex = GpuExecutor(model, options_of(num_kv_blocks=None, gpu_memory_utilization=utilization, max_model_len=8192,
                                       max_num_batched_tokens=8192, max_num_seqs=256, progress=False,
                                       cuda_graphs=False, kv_cache_dtype=kv_cache_dtype))
    row = dict(kv_cache_dtype=kv_cache_dtype, blocks=ex.num_kv_blocks, pool_gib=ex.kv_cache.nbytes / 2**30,
               block_bytes=ex.kv_block_bytes)
    ex.close()
    return row


def decode_at(model, kv_cache_dtype: str, batch: int, prompt: int, steps: int, bw: float) -> dict:
    """bench/decode.py's run_batch on an executor of this KV dtype, its roofline with the KV's own bytes."""
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of

    per_seq = -(-(prompt + steps + 1) // BLOCK_SIZE)
    ex = GpuExecutor(model, options_of(num_kv_blocks=batch * per_seq + 16, max_model_len=per_seq * BLOCK_SIZE,
                                       max_num_batched_tokens=max(2048, batch, prompt), max_num_seqs=batch,
                                       progress=False, kv_cache_dtype=kv_cache_dtype))
    row = run_batch(ex, model, batch, prompt, steps, bw)
    itemsize = 1 if kv_cache_dtype == "fp8" else 2
    weights = sum(int(a.size) * 2 for a in model.weights.values())
    kv = batch * (prompt + steps / 2) * model.model.kv_layout().token_values * itemsize
    row.update(kv_cache_dtype=kv_cache_dtype, kv_bytes=kv, roofline_ms=(weights + kv) / bw * 1e3)
    row["roofline_fraction"] = row["roofline_ms"] / row["graph_ms"]
    ex.close()
    return row


def report(res: dict, out: str, stem: str) -> str:
    blocks, rows = {r["kv_cache_dtype"]: r for r in res["blocks"]}, {r["kv_cache_dtype"]: r for r in res["decode"]}
    lines = [f"# --kv-cache-dtype fp8 vs bf16 KV, {res['model']}", "",
             f"{res['date']}, {res['gpu']}, `{res['command']}`; device-copy bandwidth {res['bandwidth'] / 1e12:.2f} TB/s",
             "", f"## KV blocks at gpu_memory_utilization {res['utilization']} (target 2.0x)", "",
             "| KV | blocks | pool GiB | bytes a block |", "|---|---|---|---|"]
    lines += [f"| {d} | {blocks[d]['blocks']} | {blocks[d]['pool_gib']:.2f} | {blocks[d]['block_bytes']} |" for d in DTYPES]
    lines += ["", f"fp8 / bf16 blocks: **{blocks['fp8']['blocks'] / blocks['bfloat16']['blocks']:.3f}x**", "",
              f"## Decode, batch {res['batch']}, context {res['prompt']} -> {res['prompt'] + res['steps']} "
              f"(target fp8 >= 1.3x faster)", "",
              "| KV | ms/step | less host ms | graph replay ms | tokens/s | roofline ms | graph fraction | KV GB read |",
              "|---|---|---|---|---|---|---|---|"]
    for d in DTYPES:
        r = rows[d]
        lines.append(f"| {d} | {r['ms_per_step']:.3f} | {r['device_ms']:.3f} | {r['graph_ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['roofline_ms']:.3f} | {r['roofline_fraction']:.2f} | "
                     f"{r['kv_bytes'] / 1e9:.2f} |")
    same = np.mean([a == b for a, b in zip(rows["bfloat16"]["first_tokens"], rows["fp8"]["first_tokens"])])
    lines += ["", f"bf16 / fp8 step (graph replay): **{rows['bfloat16']['graph_ms'] / rows['fp8']['graph_ms']:.3f}x**, "
              f"(wall) {rows['bfloat16']['ms_per_step'] / rows['fp8']['ms_per_step']:.3f}x; sequences whose first 4 "
              f"greedy tokens agree between the two: {same:.2f} (random weights: FP8 rounding flips near-ties)"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="run only the first N layers")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--utilization", type=float, default=0.9)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    p.add_argument("--stem", default=None, help="output names (default quantization-kv, -MODEL beside qwen3-8b)")
    a = p.parse_args()
    stem = a.stem or ("quantization-kv" if a.model == "qwen3-8b" else f"quantization-kv-{a.model}")
    os.makedirs(a.out, exist_ok=True)
    import cupy
    import torch

    from engine.loader import load_model
    from harness.models import write_random_qwen3

    folder = random_weights_folder(a.model, a.layers)
    t = time.perf_counter()
    hf = write_random_qwen3(config_path(a.model, a.layers), folder)
    del hf
    torch.cuda.empty_cache()
    print(f"[{a.model}] random weights in {folder}: {time.perf_counter() - t:.1f}s", flush=True)
    model = load_model(folder)
    bw = copy_bandwidth()
    cupy.get_default_memory_pool().free_all_blocks()      # the copy's 8 GB back before the pools are sized
    res = dict(model=a.model + (f" (first {a.layers} layers)" if a.layers else ""), layers=a.layers,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), command=" ".join(sys.argv),
               bandwidth=bw, utilization=a.utilization, batch=a.batch, prompt=a.context - a.steps, steps=a.steps,
               blocks=[pool_blocks_at(model, d, a.utilization) for d in DTYPES], decode=[])
    print(json.dumps(res["blocks"]), flush=True)
    for d in DTYPES:                       # write after each: a cut-off run keeps what it measured
        row = decode_at(model, d, a.batch, a.context - a.steps, a.steps, bw)
        res["decode"].append(row)
        print(f"[{d}] {row['ms_per_step']:.3f} ms/step, graph {row['graph_ms']:.3f} ms", flush=True)
        with open(os.path.join(a.out, f"{stem}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(report(res, a.out, stem))


if __name__ == "__main__":
    main()
