"""Decode benchmark of a real-width, reduced-depth Kimi-K2 (DeepSeek-V3 architecture) on one H200: random
weights in a real quantized checkpoint format (bench/deepseek_weights.py: Kimi-K2-Thinking's int4 experts,
or DeepSeek-V3's FP8 blocks), read by the engine's loader (dequantized at load to bf16: the GPU has no
kept-quantized kernels yet), CUDA-graph decode at batch 1 / 32 (bench/decode.py's run_batch), prompt 128,
256 steps.

Rooflines (bytes read per step / the device-copy bandwidth measured in the same run): "bf16" counts what the
engine reads as it holds the weights (every dense weight, the experts the batch's tokens route to in
expectation under uniform routing, E·(1 - (1 - k/E)^B) per layer, and the latent KV); "stored" counts the
same weights at their checkpoint bytes (int4 + scales, or fp8 + scales): the floor a kept-quantized path
would have. Writes OUT/deepseek.json and OUT/deepseek.md.

    python3 bench/deepseek.py --out bench/results [--layers 4] [--format int4|fp8] [--batches 1,32] [--write-only]

Sizes (kimi-k2, 4 layers = 1 dense + 3 MoE): 54.0 G parameters (each MoE layer 16.9 G, embedding and
lm_head 1.17 G each); stored ~35 GB int4 / ~57 GB fp8 (use --layers 3 for fp8 on a 64 GB disk); dequantized
bf16 ~108 GB, held on the host while loading and then on the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode import BLOCK_SIZE, config_path, copy_bandwidth, run_batch, step_weight_bytes  # noqa: E402
from bench.deepseek_weights import EXPERT, write_random_quantized  # noqa: E402


def stored_step_bytes(model, stored: dict[str, int], batch: int) -> int:
    """Checkpoint bytes one decode step reads if kept as stored: dense tensors whole, the experts' at the
    expected fraction the batch routes to."""
    s = model.model.expert_shape
    frac = 1 - (1 - s.top_k / s.num_experts) ** batch
    return int(sum(b * (frac if EXPERT in n else 1.0) for n, b in stored.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-k2")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--format", choices=("int4", "fp8"), default="int4")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    p.add_argument("--write-only", action="store_true", help="only write the checkpoint (reused by a later run)")
    a = p.parse_args()
    import ml_dtypes

    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model

    batches = [int(b) for b in a.batches.split(",")]
    folder = f"/tmp/{a.model}-L{a.layers}-{a.format}"
    t = time.perf_counter()
    stored = write_random_quantized(config_path(a.model, a.layers), folder, a.format)
    print(f"[{a.model}] {a.format} checkpoint in {folder}: {time.perf_counter() - t:.1f}s, "
          f"{sum(stored.values()) / 1e9:.2f} GB stored", flush=True)
    if a.write_only:
        return
    t = time.perf_counter()
    model = load_model(folder, dequant_dtype=ml_dtypes.bfloat16)
    load_s = time.perf_counter() - t
    weight_bytes = sum(int(w.size) * 2 for w in model.weights.values())
    print(f"[{a.model}] loaded (dequantized to bf16) in {load_s:.1f}s: {weight_bytes / 1e9:.2f} GB", flush=True)
    bw = copy_bandwidth()
    per_seq = -(-(a.prompt + a.steps + 1) // BLOCK_SIZE)
    t = time.perf_counter()
    ex = GpuExecutor(model, options_of(num_kv_blocks=max(batches) * per_seq + 16, max_model_len=per_seq * BLOCK_SIZE,
                                       max_num_batched_tokens=2048, max_num_seqs=max(batches), progress=False))
    print(f"[{a.model}] executor up in {time.perf_counter() - t:.1f}s; {ex.gemm.describe()}", flush=True)
    rows = []
    for b in batches:
        r = run_batch(ex, model, b, a.prompt, a.steps, bw)
        r.pop("first_tokens")
        kv = b * (a.prompt + a.steps / 2) * model.model.kv_layout().token_values * 2
        r["stored_roofline_ms"] = (stored_step_bytes(model, stored, b) + kv) / bw * 1e3
        r["bf16_weight_gb_per_step"] = step_weight_bytes(model, b) / 1e9
        rows.append(r)
        print(f"[{a.model}] {json.dumps(r)}", flush=True)
    ex.close()
    meta = dict(model=a.model, layers=a.layers, format=a.format, copy_bandwidth_gbs=bw / 1e9, load_s=load_s,
                stored_gb=sum(stored.values()) / 1e9, bf16_gb=weight_bytes / 1e9, prompt=a.prompt, steps=a.steps)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "deepseek.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# {a.model}, {a.layers} layers, {a.format} checkpoint dequantized to bf16 at load", "",
             f"copy bandwidth {bw / 1e9:.0f} GB/s; stored {meta['stored_gb']:.1f} GB, bf16 {meta['bf16_gb']:.1f} GB; "
             f"load {load_s:.0f} s", "",
             "| batch | ms/step | tok/s | bf16 roofline ms | fraction | stored-format roofline ms | graph ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | {r['roofline_ms']:.2f} | "
              f"{r['roofline_fraction']:.2f} | {r['stored_roofline_ms']:.2f} | {r['graph_ms']:.2f} |" for r in rows]
    with open(os.path.join(a.out, "deepseek.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
