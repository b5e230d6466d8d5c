"""Decode benchmark of a real-width, reduced-depth DeepSeek-V3-architecture Kimi-K2 or DeepSeek-V4-Flash on one
H200: random weights in a real quantized checkpoint format (bench/deepseek_weights.py: Kimi-K2-Thinking's int4
experts or DeepSeek-V3's FP8 blocks; DeepSeek-V4's FP8 projections with FP4 experts), read by the engine's loader
(the routed experts kept as shipped, engine/models/quant_experts.py, on the quantized grouped GEMVs; the rest
dequantized to bf16), decode at batch 1 / 32 (bench/decode.py's run_batch: CUDA-graph decode, the host's share of a
step in the JSON's host_ms / host_fraction), prompt 128, 256 steps (--steps).

Rooflines (bytes read per step / the device-copy bandwidth measured in the same run): "bf16" counts every weight
at bf16 (every dense weight, the whole embedding table included, the experts the batch's tokens route to in
expectation under uniform routing, E·(1 - (1 - k/E)^B) per layer, and the KV rows): what an engine holding
everything in bf16 would read, the scale of the earlier figures; "stored" counts the same weights at their
checkpoint bytes (int4 + scales, or fp8 / fp4 + scales): the bytes actually read where the experts are kept and
the rest is stored bf16 (Kimi-K2 int4; issue 55's goal: batch 1 at >= 0.70 of it, the experts' memory <= 0.30 x
bf16: `stored_fraction` and `experts_memory_ratio`); "held" counts what this engine reads as it holds the weights
(held_step_bytes: kept experts packed, the rest bf16 -- V4's FP8 projections are dequantized at load -- and of
the embedding only the batch's rows): the bytes a step of this engine must read. Writes OUT/STEM.json and
OUT/STEM.md after each batch (STEM: deepseek, deepseek-v4 for V4).

    python3 bench/deepseek.py --out bench/results [--model kimi-k2|deepseek-v4-flash] [--layers 4]
        [--format int4|fp8] [--batches 1,32] [--op-times] [--eager] [--write-only] [--sizes]
        [--prefill-memory 8x1024,1x8192] [--prefill-op-times 1x8192]

Sizes (kimi-k2, 4 layers = 1 dense + 3 MoE): 54.0 G parameters (each MoE layer 16.9 G, embedding and
lm_head 1.17 G each); stored ~35 GB int4 / ~57 GB fp8 (use --layers 3 for fp8 on a 64 GB disk); dequantized
bf16 ~108 GB, held on the host while loading and then on the GPU.
(deepseek-v4-flash, 4 layers = sliding, sliding, compressed-sparse, heavily-compressed attention; hash-routed MLPs,
then one score-routed: every layer's 256 experts of 2048, top-6): 27.4 G parameters (each layer's experts 6.4 G,
embedding and head 0.53 G each); stored 16.4 GB (fp8 + fp4 experts); dequantized bf16 54.8 GB. --sizes prints
these from the config without writing anything.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode import (BLOCK_SIZE, GREEDY, config_path, copy_bandwidth, op_breakdown,  # noqa: E402
                          routed_fraction, run_batch, step_weight_bytes)
from bench.deepseek_weights import EXPERT, planned_bytes, write_random_quantized  # noqa: E402


def stored_step_bytes(model, stored: dict[str, int], batch: int) -> int:
    """Checkpoint bytes one decode step reads if kept as stored: dense tensors whole, the experts' at the
    expected fraction the batch routes to."""
    frac = routed_fraction(model, batch)
    return int(sum(b * (frac if EXPERT in n else 1.0) for n, b in stored.items()))


def held_step_bytes(model, batch: int) -> int:
    """Weight bytes one decode step reads as the engine holds them (device_nbytes: kept experts at their packed
    codes and scales, the rest bf16): the routed experts at the expected fraction the batch touches, of the
    embedding only the batch's rows."""
    from engine.executor.gpu_quant_ops import device_nbytes
    frac = routed_fraction(model, batch)
    total = 0.0
    for name, w in model.weights.items():
        n = device_nbytes(w)
        total += n * frac if ".experts_" in name else n * batch / w.shape[0] if name == "embed_tokens" else n
    return int(total)


FORMATS = {"kimi-k2": "int4", "deepseek-v4-flash": "fp8"}     # each model's default checkpoint format


def sizes_line(model_name: str, config: str, fmt: str) -> str:
    """Parameters, stored and bf16 bytes of the checkpoint write_random_quantized would write (nothing written)."""
    import numpy as np

    from engine.model_config import ModelConfig
    from engine.models.registry import build_model

    model = build_model(ModelConfig.from_file(config))
    shapes = {n: s for spec in model.weight_specs() for n, s in spec.parts}
    params = sum(int(np.prod(s)) for s in shapes.values())
    experts = sum(int(np.prod(s)) for n, s in shapes.items() if EXPERT in n)
    stored = sum(planned_bytes(config, fmt).values())
    return (f"[{model_name}] {model.config.num_hidden_layers} layers: {params / 1e9:.2f} G parameters (routed experts "
            f"{experts / 1e9:.2f} G); stored {stored / 1e9:.2f} GB {fmt}; bf16 {2 * params / 1e9:.2f} GB")


def prefill_memory(ex, vocab: int, shapes: list[tuple[int, int]]) -> list[dict]:
    """Each prefill shape (sequences, tokens each) as one eager step from an emptied CuPy pool: its wall time and
    the pool's bytes after it beyond those held before (freed blocks stay cached there: the step's peak,
    fragmentation included; as tests/gpu/test_gpu_dsv4.py counts it) against
    what the ops declare and the executor leaves free for them (gpu_arena_sizes.eager_pool_nbytes of the plan)."""
    import cupy

    from engine.batch import ModelBatch
    from engine.executor.gpu_arena_sizes import eager_pool_nbytes

    pool, rows = cupy.get_default_memory_pool(), []
    for seqs, tokens in shapes:
        steps = prefill_steps(vocab, seqs, tokens)
        ex.stream.synchronize()
        pool.free_all_blocks()
        held, t = pool.used_bytes(), time.perf_counter()
        ex.execute(ModelBatch.build(steps))
        rows.append(dict(seqs=seqs, tokens=tokens, ms=(time.perf_counter() - t) * 1e3, held_before_gib=held / 2**30,
                         pool_gib=(pool.total_bytes() - held) / 2**30, declared_gib=eager_pool_nbytes(ex.plan) / 2**30))
        print(f"[prefill memory] {json.dumps(rows[-1])}", flush=True)
    return rows


def prefill_steps(vocab: int, seqs: int, tokens: int, seed: int = 0) -> list:
    """`seqs` fresh prompts of `tokens` random ids each, in disjoint KV blocks from block 0."""
    import numpy as np

    from engine.batch import SeqStep
    rng, per_seq = np.random.default_rng(seed), -(-(tokens + 1) // BLOCK_SIZE)
    return [SeqStep(seq_id=j, token_ids=rng.integers(0, vocab - 1000, tokens).tolist(), start_pos=0,
                    block_table=list(range(j * per_seq, (j + 1) * per_seq)), sample=True, params=GREEDY,
                    prompt_len=tokens, state_slot=j) for j in range(seqs)]


def prefill_op_times(ex, vocab: int, seqs: int, tokens: int, depths: int = 2) -> dict:
    """One eager prefill step of `seqs` x `tokens` timed op by op (CUDA events, bench/op_timer.py), after one
    untimed step of the same shape (kernels compiled, the CuPy pool warm). Prefill ops are long enough that the
    events measure the device, not the host's launch gaps as in a decode step."""
    from bench.op_timer import time_ops
    from engine.batch import ModelBatch

    batch = ModelBatch.build(prefill_steps(vocab, seqs, tokens))
    ex.execute_eager(batch)
    ex.stream.synchronize()
    t = time.perf_counter()
    ex.execute_eager(batch)                 # the step as served: no events between its ops
    ex.stream.synchronize()
    plain = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    rows = [r for r in time_ops(ex, lambda: ex.execute_eager(batch)) if r.depth < depths]
    ms = (time.perf_counter() - t) * 1e3
    return dict(seqs=seqs, tokens=tokens, plain_ms=plain, step_ms=ms, ops=[dict(op=r.op, depth=r.depth, calls=r.calls, ms=r.ms,
                                                                roofline_fraction=None)
                                                           for r in sorted(rows, key=lambda r: (r.depth, -r.ms))])


def op_table(ops: list[dict], title: str = "One eager batch-1 decode step by op") -> list[str]:
    """Op times (bench/decode.py's op_breakdown, prefill_op_times) as markdown lines: the ops the model code
    calls, then (depth 1) the ones they compose."""
    if not ops:
        return []
    lines = ["", f"{title} (CUDA events; depth 1: inside a depth-0 op):", "",
             "| op | depth | calls | ms | weight roofline fraction |", "| --- | --- | --- | --- | --- |"]
    return lines + [f"| {o['op']} | {o['depth']} | {o['calls']} | {o['ms']:.3f} | "
                    f"{'-' if o['roofline_fraction'] is None else format(o['roofline_fraction'], '.2f')} |" for o in ops]


def write_report(out: str, stem: str, meta: dict, rows: list[dict]) -> str:
    """OUT/STEM.json and OUT/STEM.md of the rows so far; returns the markdown."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    fmt = meta["format"] + (" (FP8 projections, FP4 experts)" if meta["model"].startswith("deepseek-v4") else "")
    steps = "CUDA-graph decode" if meta["graphs"] else "eager decode steps (the line captures no CUDA graphs)"
    lines = [f"# {meta['model']}, {meta['layers']} layers, {fmt} checkpoint, experts kept; {steps}", "",
             f"copy bandwidth {meta['copy_bandwidth_gbs']:.0f} GB/s; stored {meta['stored_gb']:.1f} GB, held "
             f"{meta['held_gb']:.1f} GB (bf16 {meta['bf16_gb']:.1f} GB); routed experts held "
             f"{meta['experts_memory_ratio']:.3f} x bf16; load {meta['load_s']:.0f} s, executor up "
             f"{meta['executor_s']:.0f} s", "",
             "| batch | ms/step | tok/s | bf16 roofline ms | fraction | stored-format roofline ms | fraction | "
             "held roofline ms | fraction | graph ms | host share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | {r['roofline_ms']:.2f} | "
              f"{r['roofline_fraction']:.2f} | {r['stored_roofline_ms']:.2f} | {r['stored_fraction']:.2f} | "
              f"{r['held_roofline_ms']:.2f} | {r['held_fraction']:.2f} | "
              f"{'-' if math.isnan(r['graph_ms']) else format(r['graph_ms'], '.2f')} | {r['host_fraction']:.2f} |"
              for r in rows]
    lines += op_table(meta.get("op_times") or [])
    if meta.get("prefill_op_times"):
        pre = meta["prefill_op_times"]
        lines += op_table(pre["ops"], f"One eager prefill step of {pre['seqs']} x {pre['tokens']} tokens by op, "
                                      f"{pre['step_ms']:.0f} ms timed ({pre.get('plain_ms', float('nan')):.0f} ms "
                                      f"untimed)")
    if meta.get("prefill_memory"):
        lines += ["", "Eager prefill steps from an emptied CuPy pool (its bytes after the step: the peak) against what "
                  "the executor leaves outside its arena for them (eager_pool_nbytes):", "",
                  "| sequences x tokens | step ms | pool GiB | declared GiB |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['seqs']} x {r['tokens']} | {r['ms']:.0f} | {r['pool_gib']:.2f} | {r['declared_gib']:.2f} |"
                  for r in meta["prefill_memory"]]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-k2", choices=sorted(FORMATS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--format", choices=("int4", "fp8"), default=None,
                   help="checkpoint format (default: int4 for kimi-k2; fp8, with FP4 experts, for deepseek-v4-flash)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    p.add_argument("--stem", default=None, help="output names STEM.json / STEM.md (default deepseek, deepseek-v4)")
    p.add_argument("--write-only", action="store_true", help="only write the checkpoint (reused by a later run)")
    p.add_argument("--op-times", action="store_true", help="also time one eager batch-1 step op by op")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (a quick --op-times run: no capture)")
    p.add_argument("--max-tokens", type=int, default=2048, help="the executor's max_num_batched_tokens")
    p.add_argument("--prefill-memory", default="", help="prefill shapes SEQSxTOKENS,.. (e.g. 8x1024,1x8192): each "
                   "one eager step, its CuPy pool peak against eager_pool_nbytes (within --max-tokens)")
    p.add_argument("--prefill-op-times", default="", help="SEQSxTOKENS: one eager prefill step of that shape timed "
                   "op by op (within --max-tokens)")
    p.add_argument("--sizes", action="store_true", help="only print the checkpoint's sizes (no GPU, nothing written)")
    p.add_argument("--sparse-mma-rows", type=int, default=None, help="DeepSeek-V4: steps of at least this many rows "
                   "attend on dsv4_sparse_mma.cu (GpuDSV4Ops.sparse_mma_rows; default: the executor's own)")
    a = p.parse_args()
    fmt = a.format or FORMATS[a.model]
    stem = a.stem or ("deepseek-v4" if a.model.startswith("deepseek-v4") else "deepseek")
    config = config_path(a.model, a.layers)
    if a.sizes:
        print(sizes_line(a.model, config, fmt))
        return
    import ml_dtypes

    from engine.executor.gpu import GpuExecutor
    from engine.executor.gpu_quant_ops import device_nbytes
    from engine.executor.options import options_of
    from engine.loader import load_model
    from engine.models.quant_experts import Fp8Experts, W4Experts
    KEPT_EXPERTS = (Fp8Experts, W4Experts)

    batches = [int(b) for b in a.batches.split(",") if b]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.prefill_memory.split(",") if s]
    op_shape = [tuple(int(v) for v in a.prefill_op_times.split("x"))] if a.prefill_op_times else []
    folder = f"/tmp/{a.model}-L{a.layers}-{fmt}"
    t = time.perf_counter()
    stored = write_random_quantized(config, folder, fmt)
    print(f"[{a.model}] {fmt} checkpoint in {folder}: {time.perf_counter() - t:.1f}s, "
          f"{sum(stored.values()) / 1e9:.2f} GB stored", flush=True)
    if a.write_only:
        return
    t = time.perf_counter()
    model = load_model(folder, dequant_dtype=ml_dtypes.bfloat16)
    load_s = time.perf_counter() - t
    weight_bytes = sum(int(w.size) * 2 for w in model.weights.values())
    held = sum(device_nbytes(w) for w in model.weights.values())
    kept = [w for w in model.weights.values() if isinstance(w, KEPT_EXPERTS)]
    experts_ratio = sum(w.nbytes for w in kept) / max(1, sum(2 * w.size for w in kept))
    print(f"[{a.model}] loaded in {load_s:.1f}s: held {held / 1e9:.2f} GB (bf16 {weight_bytes / 1e9:.2f} GB); "
          f"{len(kept)} expert weights kept, {experts_ratio:.3f} x bf16", flush=True)
    bw = copy_bandwidth()
    per_seq = -(-(a.prompt + a.steps + 1) // BLOCK_SIZE)
    sized = shapes + op_shape           # the executor's pool and limits fit every prefill shape asked for
    blocks = max([b * per_seq for b in batches] + [s * -(-(n + 1) // BLOCK_SIZE) for s, n in sized])
    longest = max([per_seq * BLOCK_SIZE] + [n + BLOCK_SIZE for _, n in sized])
    t = time.perf_counter()
    ex = GpuExecutor(model, options_of(num_kv_blocks=blocks + 16, max_model_len=longest,
                                       max_num_batched_tokens=a.max_tokens,
                                       max_num_seqs=max(batches + [s for s, _ in sized]), progress=False,
                                       cuda_graphs=not a.eager))
    executor_s = time.perf_counter() - t
    if a.sparse_mma_rows is not None and ex.ops.dsv4 is not None:
        ex.ops.dsv4.sparse_mma_rows = a.sparse_mma_rows
    graphs = getattr(ex, "graphs", None) is not None
    print(f"[{a.model}] executor up in {executor_s:.1f}s; {ex.gemm.describe()}; "
          f"{'CUDA-graph decode' if graphs else 'eager steps only (no CUDA graphs)'}", flush=True)
    meta = dict(model=a.model, layers=a.layers, format=fmt, copy_bandwidth_gbs=bw / 1e9, load_s=load_s,
                executor_s=executor_s, stored_gb=sum(stored.values()) / 1e9, bf16_gb=weight_bytes / 1e9,
                held_gb=held / 1e9, experts_memory_ratio=experts_ratio,
                prompt=a.prompt, steps=a.steps, graphs=graphs,
                sparse_mma_rows=getattr(ex.ops.dsv4, "sparse_mma_rows", None))
    rows, text = [], ""
    if shapes:
        meta["prefill_memory"] = prefill_memory(ex, model.config.vocab_size, shapes)
        text = write_report(a.out, stem, meta, rows)
    for b in batches:        # the report is rewritten after each batch: a cut-off run keeps what it measured
        r = run_batch(ex, model, b, a.prompt, a.steps, bw)
        r.pop("first_tokens")
        kv = b * (a.prompt + a.steps / 2) * model.model.kv_layout().token_values * 2
        r["stored_roofline_ms"] = (stored_step_bytes(model, stored, b) + kv) / bw * 1e3
        r["stored_fraction"] = r["stored_roofline_ms"] / r["ms_per_step"]
        r["held_roofline_ms"] = (held_step_bytes(model, b) + kv) / bw * 1e3
        r["held_fraction"] = r["held_roofline_ms"] / r["ms_per_step"]
        r["bf16_weight_gb_per_step"] = step_weight_bytes(model, b) / 1e9
        rows.append(r)
        print(f"[{a.model}] {json.dumps(r)}", flush=True)
        text = write_report(a.out, stem, meta, rows)
    if a.op_times:
        meta["op_times"] = op_breakdown(ex, None, bw, depths=2)
        text = write_report(a.out, stem, meta, rows)
    if op_shape:
        seqs, tokens = op_shape[0]
        meta["prefill_op_times"] = prefill_op_times(ex, model.config.vocab_size, seqs, tokens)
        text = write_report(a.out, stem, meta, rows)
    ex.close()
    print(text)


if __name__ == "__main__":
    main()
