"""MoE and MLA decode kernels timed inside captured graphs (programmatic dependent launches, as a decode
step runs them), per launch shape or compile variant, on the GPU:

- `experts`: moe_gemv.cu's ungrouped decode experts (moe_gemv_silu then moe_gemv_combine) of LAYERS
  layers back to back, each layer's tokens routed to experts no other layer reads (the weights stream
  from HBM, as in a step), per compile variant (MOE_UNROLL, COMBINE_COLS; every variant gives the same
  bits), at DeepSeek-V2-Lite's and Qwen3-30B-A3B's shapes; µs per layer and the fraction of the HBM
  roofline (the routed experts' bytes / copy bandwidth).
- `mla`: ops.mla.attention's absorbed form (W_UK, mla_decode.cu, W_UV) of a DeepSeek-V2-Lite layer (random
  weights, 2 layers, through the real loader) per KV split count and heads per CTA, the executor's
  choice marked.

    python3 bench/moe_micro.py --out DIR [--parts experts,mla]

Writes DIR/moe_micro.json and DIR/moe_micro.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode_micro import rand_bf16, time_ms  # noqa: E402

SHAPES = {"deepseek-v2-lite": dict(E=64, H=2048, I=1408, K=6), "qwen3-30b-a3b": dict(E=128, H=2048, I=768, K=8)}
VARIANTS = [dict(MOE_UNROLL=u, COMBINE_COLS=c) for u in (2, 4) for c in (8, 4, 2)]
LAYERS = 8


def graph_us(stream, body, calls: int, reps: int = 20) -> float:
    """µs per call of `body` (which queues `calls` calls) replayed as one captured graph."""
    body()
    stream.synchronize()
    stream.begin_capture()
    body()
    graph = stream.end_capture()
    return time_ms(stream, lambda: graph.launch(stream=stream), reps) / calls * 1e3


def expert_rows(bw: float, tokens=(1, 4)) -> list[dict]:
    import cupy

    from openinfer_kernels.raw_cuda import kernel
    from openinfer_kernels.raw_cuda.launch import launch

    stream, rows = cupy.cuda.Stream(non_blocking=True), []
    for name, s in SHAPES.items():
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        gate_up, down = rand_bf16((E, 2 * I, H)), rand_bf16((E, H, I))
        for T in tokens:
            per = T * K                                     # distinct experts a layer reads
            layers = min(LAYERS, E // per)
            ids = [cupy.asarray(np.arange(l * per, (l + 1) * per, dtype=np.int32)) for l in range(layers)]
            weights = cupy.full(T * K, 1.0 / K, np.float32)
            x, residual = rand_bf16((T, H)), rand_bf16((T, H))
            act, out = cupy.zeros((T * K, I), np.uint16), cupy.zeros((T, H), np.uint16)
            for v in VARIANTS:
                k_silu = kernel("moe_gemv", "moe_gemv_silu", **v)
                k_comb = kernel("moe_gemv", "moe_gemv_combine", **v)
                cols = v["COMBINE_COLS"]

                def silu(lid):
                    launch(k_silu, (-(-I // 16), T * K), (128,), (x, gate_up, lid, act, np.int32(I), np.int32(H),
                                                                   np.int32(K), np.int32(1)), stream, pdl=True)

                def comb(lid):
                    launch(k_comb, (-(-H // cols), T), (32 * min(K, 8),),
                           (act, down, lid, weights, residual, out, np.int32(H), np.int32(I), np.int32(K)),
                           stream, pdl=True)

                parts = {"silu": lambda: [silu(lid) for lid in ids], "combine": lambda: [comb(lid) for lid in ids],
                         "both": lambda: [(silu(lid), comb(lid)) for lid in ids]}
                nbytes = {"silu": per * 2 * I * H * 2, "combine": per * H * I * 2}
                nbytes["both"] = nbytes["silu"] + nbytes["combine"]
                for part, body in parts.items():
                    us = graph_us(stream, body, layers)
                    rows.append(dict(part="experts", model=name, tokens=T, kernel=part, variant=v, us=us,
                                     roofline_fraction=nbytes[part] / bw / (us * 1e-6)))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def mla_rows(bw: float, cases=((1, 176), (1, 1024), (1, 4096), (8, 176), (8, 1024))) -> list[dict]:
    from bench.decode import config_path, random_weights_folder
    from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep
    from bench.ab_switches import ABGpuExecutor
    from engine.executor.gpu_mla_ops import mla_decode_shape
    from engine.executor.options import options_of
    from engine.loader import load_model
    from engine.request import SamplingParams
    from harness.models import write_random_qwen3

    name, max_len = "deepseek-v2-lite", 4096
    folder = random_weights_folder(name, 2)
    write_random_qwen3(config_path(name, 2), folder)
    model = load_model(folder)
    max_b = max(b for b, _ in cases)
    ex = ABGpuExecutor(model, options_of(num_kv_blocks=max_b * max_len // BLOCK_SIZE + 16, max_model_len=max_len,
                                         max_num_batched_tokens=2048, max_num_seqs=max_b, progress=False))
    ops, spec = ex.ops, model.model.attention_specs[1]
    kv_b = ex.weights["layers.1.kv_b_proj"]
    H, rows = spec.num_heads, []
    for B, ctx_len in cases:
        per_seq = -(-ctx_len // BLOCK_SIZE)
        seqs = [SeqStep(seq_id=j, token_ids=[1], start_pos=ctx_len - 1, sample=True,
                        params=SamplingParams(temperature=0.0),
                        block_table=list(range(j * per_seq, (j + 1) * per_seq))) for j in range(B)]
        ctx = ex.upload(ModelBatch.build(seqs))
        ctx.batch = None                                   # the absorbed form, as a decode graph runs it
        q = rand_bf16((B, H * spec.qk_dim))
        chosen = mla_decode_shape(B, ctx.num_splits, H, ops.shared.num_sms)
        for S in sorted({1, 2, 4, 8, 16, 32, ctx.num_splits}):
            for G in (1, 2, 4, 8, 16):
                c = dataclasses.replace(ctx, num_splits=S)
                ops.shared.pdl, ops.mla.group = True, G

                def body():
                    ops.reset()
                    for _ in range(LAYERS):
                        ops.mla.attention(q, kv_b, spec, c)
                us = graph_us(ex.stream, body, LAYERS)
                ops.shared.pdl, ops.mla.group = False, None
                floor = B * ctx_len * (spec.kv_lora_rank + spec.rope_dim) * 2 / bw * 1e6
                rows.append(dict(part="mla", model=name, tokens=B, context=ctx_len, splits=S, group=G, us=us,
                                 chosen=(S, G) == chosen,
                                 floor_us=floor))
                print(json.dumps(rows[-1]), flush=True)
    ex.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | tokens | kernel | MOE_UNROLL | COMBINE_COLS | µs per layer | roofline fraction |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['tokens']} | {r['kernel']} | {r['variant']['MOE_UNROLL']} | "
              f"{r['variant']['COMBINE_COLS']} | {r['us']:.1f} | {r['roofline_fraction']:.2f} |"
              for r in rows if r["part"] == "experts"]
    lines += ["", "| tokens | context | splits | heads per CTA | µs per layer | chosen |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['context']} | {r['splits']} | {r['group']} | {r['us']:.1f} | "
              f"{'yes' if r['chosen'] else ''} |" for r in rows if r["part"] == "mla"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="experts,mla")
    args = p.parse_args()
    from bench.decode import copy_bandwidth
    import cupy

    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    rows = []
    parts = args.parts.split(",")
    if "experts" in parts:
        rows += expert_rows(bw)
    if "mla" in parts:
        rows += mla_rows(bw)
    result = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), copy_bandwidth=bw, rows=rows)
    with open(os.path.join(args.out, "moe_micro.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "moe_micro.md"), "w") as f:
        f.write(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
