"""Tensor-parallel benchmark on one 2-GPU host: Qwen3-8B real shape (random bf16 weights, bench/configs),
CUDA-graph decode at batch 1 and 32 with TP=1 and TP=2 on the same machine (issue 31's target: the TP=2
batch-1 step at most 0.6 x TP=1's), the NCCL all-reduce latency and bus bandwidth in the same run
(bf16, from a decode step's 8 KB to 256 MB, measured by the TP=2 ranks themselves: nccl-tests' busbw =
algbw · 2(N-1)/N), and with --serve the serving benchmark at rate inf (bench/serve_gpu.py: 1000 random
1024/128 requests, vLLM's defaults) with --tensor-parallel-size 1 and 2.

    python3 bench/tp.py --out DIR [--model qwen3-8b] [--batches 1,32] [--steps 128] [--serve]

Per (TP, batch): ms per step (wall, median), host ms, tokens/s, the weight-read floor of one GPU's
share (the step's weight + KV bytes / N / the device-copy bandwidth measured here) and the fraction of
first greedy tokens equal to TP=1's. Writes DIR/tp.json and DIR/tp.md (copy them to bench/results/ with
the date, the GPUs and the command).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode import copy_bandwidth, run_batch  # noqa: E402
from engine.batch import BLOCK_SIZE  # noqa: E402

ALL_REDUCE_BYTES = [8 << 10, 64 << 10, 256 << 10, 1 << 20, 8 << 20, 64 << 20, 256 << 20]


def executor(model, tp: int, batches: list[int], prompt: int, steps: int):
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.parallel.launch import create_parallel_executor

    per_seq = -(-(prompt + steps + 1) // BLOCK_SIZE)
    options = options_of(num_kv_blocks=max(batches) * per_seq + 16, max_model_len=per_seq * BLOCK_SIZE,
                         max_num_batched_tokens=max(2048, max(batches)), max_num_seqs=max(batches), progress=False,
                         tensor_parallel_size=tp)
    return GpuExecutor(model, options) if tp == 1 else create_parallel_executor(model, options, "cuda")


def decode_rows(model, tps: list[int], batches: list[int], prompt: int, steps: int, bw: float) -> tuple[list, list]:
    rows, first, all_reduce = [], {}, []
    for tp in tps:
        t = time.perf_counter()
        ex = executor(model, tp, batches, prompt, steps)
        print(f"[tp{tp}] executor up in {time.perf_counter() - t:.1f}s", flush=True)
        try:
            for b in batches:
                r = run_batch(ex, model, b, prompt, steps, bw)
                toks = r.pop("first_tokens")
                ref = first.setdefault(b, toks)
                r.update(tp=tp, roofline_ms=r["roofline_ms"] / tp, first_tokens_same=sum(
                    x == y for x, y in zip(toks, ref)) / len(ref))
                r["roofline_fraction"] = r["roofline_ms"] / r["ms_per_step"]
                rows.append(r)
                print(f"[tp{tp}] {json.dumps(r)}", flush=True)
            if tp > 1:
                all_reduce = ex.call("measure_all_reduce", ALL_REDUCE_BYTES)
                print(f"[tp{tp}] all-reduce {json.dumps(all_reduce)}", flush=True)
        finally:
            ex.close()
    return rows, all_reduce


def serve_rows(name: str, folder: str, tps: list[int], out: Path, tokenizer: str) -> dict:
    from bench.serve_gpu import run_model

    return {f"tp{tp}": run_model(name, ["inf"], out, tokenizer, ["--tensor-parallel-size", str(tp)], folder=folder)
            for tp in tps}


def report(result: dict) -> str:
    lines = [f"# Tensor parallelism, {result['model']} on {result['device']} x{result['gpus']}", "",
             f"Device-copy bandwidth {result['copy_bandwidth'] / 1e9:.0f} GB/s (read + write).", "",
             "| TP | batch | ms/step | host ms | tokens/s | floor ms (1/N of the bytes) | of floor | vs TP=1 | "
             "first tokens = TP=1 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["batch"]: r["ms_per_step"] for r in result["decode"] if r["tp"] == 1}
    for r in result["decode"]:
        vs = r["ms_per_step"] / base[r["batch"]] if r["batch"] in base else float("nan")
        lines.append(f"| {r['tp']} | {r['batch']} | {r['ms_per_step']:.3f} | {r['host_ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['roofline_ms']:.3f} | {r['roofline_fraction']:.2f} | {vs:.2f}x | "
                     f"{r['first_tokens_same']:.2f} |")
    lines += ["", "NCCL all-reduce (bf16, back to back on the compute stream):", "",
              "| bytes | µs | algbw GB/s | busbw GB/s |", "| --- | --- | --- | --- |"]
    lines += [f"| {a['bytes']} | {a['us']:.1f} | {a['algbw_GBps']:.1f} | {a['busbw_GBps']:.1f} |"
              for a in result["all_reduce"]]
    for key, run in result.get("serve", {}).items():
        m = run["inf"][0]
        metrics = ", ".join(f"{k} {v}" for k, v in m.items() if not isinstance(v, list))
        lines.append(f"\nServing at rate inf, {key}: {metrics}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--tps", default="1,2")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--serve", action="store_true", help="also the serving benchmark at rate inf (bench/serve_gpu.py)")
    p.add_argument("--tokenizer",
                   default=os.environ.get("OPENINFER_TEST_TOKENIZER", "/work/shared/models/qwen-tokenizer"))
    args = p.parse_args()

    import cupy

    from bench.serve_gpu import write_weights
    from engine.loader import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tps, batches = [int(x) for x in args.tps.split(",")], [int(x) for x in args.batches.split(",")]
    folder = f"/tmp/{args.model}-random"
    write_weights(args.model, folder)              # a subprocess: its torch memory is gone after
    bw = copy_bandwidth()
    model = load_model(folder)
    decode, all_reduce = decode_rows(model, tps, batches, args.prompt, args.steps, bw)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result = dict(model=args.model, device=props["name"].decode(), gpus=cupy.cuda.runtime.getDeviceCount(),
                  copy_bandwidth=bw, decode=decode, all_reduce=all_reduce)
    if args.serve:
        result["serve"] = serve_rows(args.model, folder, tps, out, args.tokenizer)
    (out / "tp.json").write_text(json.dumps(result, indent=1))
    (out / "tp.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
