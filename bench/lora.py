"""Multi-LoRA decode benchmark on the GPU: Qwen3-4B real shape (random bf16 weights, bench/configs/qwen3-4b),
random rank-16 adapters on all 7 projections (q, k, v, o, gate, up, down; written as PEFT folders and read
by the engine's loader), CUDA-graph decode steps at batch 1 and 32 with 0, 1 and 4 distinct adapters in
the batch (sequence j runs with adapter j % n; batch 1 holds one, whatever n), prompt 128, one executor
with 4 slots (--max-loras 4: the kernels' grids span every slot, empty ones return at once). Per row: ms
per step (wall, median), the graph replayed back to back (the GPU time), and the overhead of each against
the same batch without adapters. The issue's target: at most 10% at batch 32 with 4 adapters.

    python3 bench/lora.py --out DIR [--batches 1,32] [--adapters 0,1,4] [--rank 16] [--steps 128] [--layers N]
        [--qkv-compaction]   (decode steps compact the q/k/v delta with lora_expand.cu before attention,
                              instead of adding it inside the fused attention kernel, the default)
        [--norm-threads N]   (threads of the split-K LoRA norms, a multiple of 32 up to 1024, the default)

Writes DIR/lora.json and DIR/lora.md (copy them to bench/results/ with the date, GPU and command).
bench/lora_ab.sh runs it once per path (the default and the flags below) in one GPU call.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode import config_path, copy_bandwidth, random_weights_folder, run_batch  # noqa: E402
from engine.batch import BLOCK_SIZE  # noqa: E402
from engine.lora import MODULES  # noqa: E402

MLP = ("gate_proj", "up_proj", "down_proj")


def write_random_adapter(model, folder: str, rank: int, seed: int) -> str:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) of a rank-`rank` adapter on every
    projection of every layer: A ~ N(0, 1/K), B ~ N(0, 0.02²), bf16."""
    import ml_dtypes

    from engine.loader.safetensors_io import save_safetensors

    cfg, rng = model.config, np.random.default_rng(seed)
    shapes = {"q_proj": (cfg.q_size, cfg.hidden_size), "k_proj": (cfg.kv_size, cfg.hidden_size),
              "v_proj": (cfg.kv_size, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.q_size),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size), "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for module, (n, k) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{'mlp' if module in MLP else 'self_attn'}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, k)) / k ** 0.5).astype(ml_dtypes.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n, rank)) * 0.02).astype(ml_dtypes.bfloat16)
    os.makedirs(folder, exist_ok=True)
    save_safetensors(os.path.join(folder, "adapter_model.safetensors"), tensors)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(MODULES),
                   "bias": "none"}, f)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--adapters", default="0,1,4")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--layers", type=int, default=None, help="the first N layers only (a small disk)")
    p.add_argument("--qkv-compaction", action="store_true",
                   help="decode steps compact the q/k/v delta with lora_expand.cu before attention (lora_in_attention off)")
    p.add_argument("--norm-threads", type=int, default=1024,
                   help="threads of the split-K LoRA norms (GpuLoRAOps.norm_threads)")
    p.add_argument("--ops", action="store_true",
                   help="also time each op of one eager decode step per row (bench/op_timer.py), the LoRA kernels apart")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    counts = [int(a) for a in args.adapters.split(",")]

    import torch

    from bench.ab_switches import ABGpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from engine.lora import load_adapter, lora_sites
    from harness.models import write_random_qwen3

    os.makedirs(args.out, exist_ok=True)
    name = "qwen3-4b"
    folder = random_weights_folder(name, args.layers)
    write_random_qwen3(config_path(name, args.layers), folder)
    torch.cuda.empty_cache()
    model = load_model(folder)
    bw = copy_bandwidth()
    max_b, slots = max(batches), max(counts)
    per_seq = -(-(args.prompt + args.steps + 1) // BLOCK_SIZE)
    ex = ABGpuExecutor(model, options_of(num_kv_blocks=max_b * per_seq + 16, max_model_len=per_seq * BLOCK_SIZE,
                                         max_num_batched_tokens=max(2048, max_b), max_num_seqs=max_b, progress=False,
                                         max_loras=max(1, slots), max_lora_rank=args.rank))
    ex.ops.lora_in_attention = not args.qkv_compaction
    if args.norm_threads % 32 or not 32 <= args.norm_threads <= 1024:
        raise SystemExit(f"--norm-threads {args.norm_threads}: want a multiple of 32 in 32..1024")
    ex.ops.lora.norm_threads = args.norm_threads
    sites = lora_sites(ex.model)
    for slot in range(slots):
        path = write_random_adapter(model, f"/tmp/{name}-lora-r{args.rank}-{slot}", args.rank, seed=slot)
        ex.set_lora(slot, load_adapter(f"a{slot}", path, sites, model.config.num_hidden_layers, args.rank))
    print(f"[{name}] {ex.gemm.describe()}; {slots} adapters of rank {args.rank} loaded", flush=True)
    rows = []
    for b in batches:
        base = None
        for n in counts:
            t = time.perf_counter()
            r = run_batch(ex, model, b, args.prompt, args.steps, bw, adapters=n)
            r.pop("first_tokens")
            r.update(adapters=n, rank=args.rank, wall_s=time.perf_counter() - t)
            base = base or (r if n == 0 else None)
            if base is not None:
                r["step_overhead"] = r["ms_per_step"] / base["ms_per_step"] - 1
                r["graph_overhead"] = r["graph_ms"] / base["graph_ms"] - 1
            if args.ops:
                r["ops"] = eager_ops(ex, model, b, args.prompt, n)
            rows.append(r)
            print(f"[{name}] {json.dumps(r)}", flush=True)
    ex.close()
    result = dict(model=name + (f" ({args.layers} layers)" if args.layers else ""), copy_bandwidth=bw,
                  qkv_in_attention=not args.qkv_compaction,
                  norm_threads=args.norm_threads,
                  device=torch.cuda.get_device_name(), rows=rows)
    with open(os.path.join(args.out, "lora.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "lora.md"), "w") as f:
        f.write(report(result))
    print(report(result))


LORA_OPS = ("lora.add", "lora.swiglu", "lora._shrink", "lora._expand_part", "lora.norm_linear", "lora.norm_swiglu",
            "lora.add_linear_norm", "lora._expand")


def eager_ops(ex, model, batch: int, prompt: int, adapters: int) -> list[dict]:
    """CUDA-event time of each op of one eager decode step of `batch` rows at position `prompt`, sequence
    j with adapter j % adapters: the base ops as the model code calls them, and the LoRA kernels inside."""
    from bench.op_timer import OPS, time_ops
    from bench.decode import GREEDY
    from engine.batch import ModelBatch, SeqStep

    per_seq = -(-(prompt + 2) // BLOCK_SIZE)
    lora_slots = {i + 1: i for i in range(adapters)} or None
    seqs = [SeqStep(seq_id=j, token_ids=[5], start_pos=prompt, block_table=list(range(j * per_seq, (j + 1) * per_seq)),
                    sample=True, params=GREEDY, state_slot=j, lora_id=j % adapters + 1 if adapters else 0)
            for j in range(batch)]
    rows = time_ops(ex, lambda: ex.execute_eager(ModelBatch.build(seqs, lora_slots)), names=OPS + LORA_OPS)
    return [dict(op=r.op, depth=r.depth, calls=r.calls, ms=round(r.ms, 4)) for r in rows]


def ops_report(result: dict) -> list[str]:
    lines = []
    for r in result["rows"]:
        if "ops" not in r:
            continue
        lines += ["", f"Eager step, batch {r['batch']}, {r['adapters']} adapters (CUDA events per op; depth 1+: "
                  "inside another op):", "", "| op | depth | calls | ms | µs per call |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {o['op']} | {o['depth']} | {o['calls']} | {o['ms']:.3f} | {o['ms'] / o['calls'] * 1e3:.1f} |"
                  for o in r["ops"]]
    return lines


def report(result: dict) -> str:
    lines = [f"# Multi-LoRA decode, {result['model']} on {result['device']}", "",
             "| batch | adapters | ms/step | graph ms | step overhead | graph overhead |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        over = [f"{r[k] * 100:+.1f}%" if k in r else "–" for k in ("step_overhead", "graph_overhead")]
        lines.append(f"| {r['batch']} | {r['adapters']} | {r['ms_per_step']:.3f} | {r['graph_ms']:.3f} | "
                     f"{over[0]} | {over[1]} |")
    return "\n".join(lines + ops_report(result)) + "\n"


if __name__ == "__main__":
    main()
