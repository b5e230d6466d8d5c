"""Per-kernel time of one graphed decode step, measured by Nsight Compute (ncu) on the GPU host.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        --log-file DIR/ncu.csv python3 bench/decode_profile.py --model qwen3-4b --batch 1 [--layers N]
    python3 bench/decode_profile.py --parse DIR/ncu.csv --model qwen3-4b > DIR/profile.md

Any line of bench/configs (Qwen3-30B-A3B, DeepSeek-V2-Lite: its MoE and MLA kernels by name); --layers N
writes and runs only the first N layers (bench/decode.py's config_path); --folder loads a written checkpoint
instead (DeepSeek-V4-Flash: bench/deepseek.py's FP8 / FP4 folder).

The first form builds the executor on random Qwen3 weights (as bench/decode.py), prefills a prompt of
128 tokens, runs a few graphed decode steps, and brackets one more with cudaProfilerStart/Stop, so
ncu times exactly that step's kernels (each graph node on its own: ncu serializes them, so the
programmatic-dependent-launch overlap of the real step is not in these numbers, while each kernel's
own ramp-up and tail are). The second form sums the CSV per kernel (GEMVs told apart by their grid,
N / 16 CTAs) and gives each weight-streaming kernel its fraction of the HBM roofline.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COPY_TB_S = 4.25      # device-copy bandwidth of the H200 (bench/results/decode.md measures it per run)


def projection_names(cfg: dict) -> dict[int, list[tuple[str, int]]]:
    """GEMV grid size (N / 16 CTAs) -> [(projection, weight bytes)] in layer order (o_proj and down_proj
    share a grid: their calls alternate). cfg: config.json's dict; a line without a dense MLP (DeepSeek-V4) has
    its kernels named only."""
    H, heads, I = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("intermediate_size")
    if not I:
        return {}
    D, kv = cfg.get("head_dim") or H // heads, cfg.get("num_key_value_heads") or heads
    shapes = {"qkv_proj": ((heads + 2 * kv) * D, H),
              "o_proj": (H, heads * D), "gate_up_proj": (2 * I, H), "down_proj": (H, I)}
    grids: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for name, (n, k) in shapes.items():
        grids[-(-n // 16)].append((name, n * k * 2))
    return grids


def run_step(model_name: str, batch: int, prompt: int = 128, layers: int | None = None, adapters: int = 0,
             rank: int = 16, folder: str | None = None) -> None:
    """adapters: sequence j runs with random rank-`rank` LoRA adapter j % adapters (bench/lora.py's); folder: a
    model folder to load instead of writing random bf16 weights (a quantized checkpoint of bench/deepseek.py's,
    e.g. /tmp/deepseek-v4-flash-L4-fp8: DeepSeek-V4-Flash in bf16 does not fit beside its HF writer)."""
    import cupy

    from bench.decode import GREEDY, config_path, random_weights_folder, run_batch
    from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from harness.models import write_random_qwen3

    if folder is None:
        folder = random_weights_folder(model_name, layers)
        write_random_qwen3(config_path(model_name, layers), folder)
    model = load_model(folder)
    per_seq = -(-(prompt + 32) // BLOCK_SIZE)
    lora = dict(max_loras=adapters, max_lora_rank=rank) if adapters else {}
    ex = GpuExecutor(model, options_of(num_kv_blocks=batch * per_seq + 16, max_model_len=per_seq * BLOCK_SIZE,
                                       max_num_batched_tokens=2048, max_num_seqs=batch, progress=False, **lora))
    if adapters:
        from bench.lora import write_random_adapter
        from engine.lora import load_adapter, lora_sites

        sites = lora_sites(ex.model)
        for slot in range(adapters):
            path = write_random_adapter(model, f"/tmp/{model_name}-lora-r{rank}-{slot}", rank, seed=slot)
            ex.set_lora(slot, load_adapter(f"a{slot}", path, sites, model.config.num_hidden_layers, rank))
    run_batch(ex, model, batch, prompt, 8, COPY_TB_S * 1e12, adapters=adapters)     # prefill + graph capture
    seqs = [SeqStep(seq_id=j, token_ids=[7], start_pos=prompt + 8, sample=True, params=GREEDY,
                    block_table=list(range(j * per_seq, (j + 1) * per_seq)), prompt_len=prompt,
                    num_generated=8, state_slot=j, lora_id=j % adapters + 1 if adapters else 0)
            for j in range(batch)]
    mb = ModelBatch.build(seqs, {i + 1: i for i in range(adapters)} or None)
    ex.execute(mb)
    ex.stream.synchronize()
    cupy.cuda.profiler.start()
    ex.execute(mb)
    ex.stream.synchronize()
    cupy.cuda.profiler.stop()
    ex.close()


def summarize(csv_path: str, model_name: str) -> str:
    with open(os.path.join(ROOT, "bench", "configs", model_name, "config.json")) as f:
        names = projection_names(json.load(f))
    text = open(csv_path, encoding="utf-8", errors="replace").read()
    text = text[text.index('"ID"'):] if '"ID"' in text else text
    per: dict[str, list[float]] = defaultdict(list)
    nbytes: dict[str, int] = {}
    seen: dict[int, int] = defaultdict(int)
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
        us = float(row["Metric Value"].replace(",", "")) * scale.get(row.get("Metric Unit", "ns"), 1e-3)
        kname = row["Kernel Name"].split("(")[0].split("<")[0].strip()
        grid = row.get("Grid Size", "")
        label = kname
        if kname.startswith("gemv_"):
            ctas = int(grid.strip("()").split(",")[0])
            options = names.get(ctas, [(f"N={ctas * 16}", 0)])
            proj, b = options[seen[ctas] % len(options)]
            seen[ctas] += 1
            label, nbytes[f"{kname} {proj}"] = f"{kname} {proj}", b
        per[label].append(us)
    total = sum(sum(v) for v in per.values())
    lines = [f"{model_name}: {sum(len(v) for v in per.values())} kernels, {total:.0f} µs summed "
             f"(each kernel alone; the graphed step overlaps neighbours)", "",
             "| kernel | calls | µs per call (median) | µs per step | share | HBM roofline fraction |",
             "|---|---|---|---|---|---|"]
    for label, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        med = sorted(v)[len(v) // 2]
        roof = nbytes.get(label)
        frac = f"{roof / (COPY_TB_S * 1e6) / med:.2f}" if roof else "-"
        lines.append(f"| {label} | {len(v)} | {med:.1f} | {sum(v):.0f} | {sum(v) / total:.1%} | {frac} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="only the first N layers")
    p.add_argument("--adapters", type=int, default=0, help="LoRA: sequence j runs with random adapter j %% N")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--folder", default=None, help="load this model folder instead of writing random weights")
    p.add_argument("--parse", metavar="NCU_CSV", help="summarize an ncu --csv log instead of running")
    a = p.parse_args()
    if a.parse:
        print(summarize(a.parse, a.model))
    else:
        run_step(a.model, a.batch, layers=a.layers, adapters=a.adapters, rank=a.rank, folder=a.folder)


if __name__ == "__main__":
    main()
