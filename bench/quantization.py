"""Quantized weights kept quantized against bf16, in one run on one GPU (issue 55's benchmarks): Qwen3-8B at its
real shapes with random weights (bench/configs/qwen3-8b), written in bf16 (harness.models.write_random_qwen3) and
as an FP8 block-scaled checkpoint (quant_method fp8, [128, 128] weight_scale_inv: harness.quantized.fp8_folder
with a vectorized block quantizer), each read through the real loader; and the bf16 folder served with
`--quantization fp8` (per-channel weights quantized at load).

Per format, beside the bf16 figure of the same run:
* decode: the batch-1 decode step (CUDA graphs; bench/decode.py run_batch: prompt 128, 64 steps, median wall ms
  per step and the captured graph's replay time); target: FP8 block-scaled <= 0.60 x bf16;
* ttft: one 1024-token prompt's prefill step through the executor (median of 5);
* serve (bench/serve_gpu.py against `openinfer serve`, random 1024/128): c1 (concurrency 1: median TTFT; target
  <= 0.75 x bf16) and rate inf (1000 prompts: output tokens/s; target >= 1.5 x bf16).
AWQ int4 (W4A16, group 128, zero points: harness.quantized.int4_folder): the batch-1 decode step, target <= 0.40 x
bf16 (`--formats bf16,awq --parts decode`).

    python bench/quantization.py --out bench/results [--parts decode,ttft,serve] [--formats bf16,fp8,fp8-dynamic,awq]
        [--scale 1.0]

Writes OUT/<stem>.json and OUT/<stem>.md (--stem, default quantization; date, GPU, command). Runtime on an
H100 / H200 (estimated): ~2 min writing the bf16 weights, ~2-3 min each for the FP8 and AWQ copies (numpy), ~1 min
per format for decode + ttft, ~3 min per format for serve (--scale 0.2 for a smoke run).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode import copy_bandwidth, random_weights_folder, run_batch  # noqa: E402
from bench.serve_gpu import run_model, write_weights  # noqa: E402

MODEL = "qwen3-8b"
FORMATS = {               # format -> (folder suffix, `openinfer serve` / load_model quantization)
    "bf16": ("", None),
    "fp8": ("-fp8-block", None),
    "fp8-dynamic": ("", "fp8"),
    "awq": ("-awq", None),
}
TARGETS = {"decode_ms": ("<=", 0.60), "c1_median_ttft_ms": ("<=", 0.75), "inf_output_throughput": (">=", 1.5)}
AWQ_DECODE_TARGET = 0.40        # AWQ int4's batch-1 decode step against bf16's


def quantize_fp8_block_fast(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """harness.quantized.quantize_fp8_block's rule (amax / 448 per block, 1 for a zero block), vectorized for
    weights the blocks tile."""
    import ml_dtypes
    w = np.asarray(w, np.float32)
    (N, K), (bn, bk) = w.shape, block
    tiles = w.reshape(N // bn, bn, K // bk, bk)
    amax = np.abs(tiles).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    q = (tiles / scale[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn).reshape(N, K)
    return q, scale


def folders(weights_dir: str, formats: list[str]) -> dict[str, str]:
    """bf16 random weights (written once), and their FP8 block-scaled and AWQ int4 copies where asked for."""
    from harness.quantized import fp8_folder, int4_folder
    bf16 = random_weights_folder(MODEL, None, weights_dir)
    t = time.perf_counter()
    write_weights(MODEL, bf16)
    writers = {"fp8": lambda dst: fp8_folder(bf16, dst, (128, 128), quantize_fp8_block_fast),
               "awq": lambda dst: int4_folder(bf16, dst, None, "awq")}
    for fmt, write in writers.items():
        dst = bf16 + FORMATS[fmt][0]
        if fmt in formats and not os.path.exists(os.path.join(dst, ".done")):
            write(dst)
            open(os.path.join(dst, ".done"), "w").close()
    print(f"weights ready in {time.perf_counter() - t:.0f} s", flush=True)
    return {name: bf16 + suffix for name, (suffix, _) in FORMATS.items()}


def ttft_ms(ex, prompt: int = 1024, reps: int = 5) -> float:
    """One prompt's prefill step (sampling its first token), median ms."""
    from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep
    from engine.request import SamplingParams
    ids = np.random.default_rng(0).integers(0, 100000, prompt).tolist()
    blocks = list(range(-(-prompt // BLOCK_SIZE) + 1))
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        ex.execute(ModelBatch.build([SeqStep(seq_id=0, token_ids=ids, start_pos=0, block_table=blocks, sample=True,
                                             params=SamplingParams(temperature=0.0), prompt_len=prompt)]))
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times[1:]))


def executor_rows(fmt: str, folder: str, parts: list[str], bw: float) -> dict:
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    model = load_model(folder, quantization=FORMATS[fmt][1])
    ex = GpuExecutor(model, options_of(num_kv_blocks=256, max_model_len=2048, max_num_batched_tokens=2048,
                                       max_num_seqs=8, progress=False))
    try:
        row = {"weight_gb": sum(int(w.nbytes) for w in model.weights.values()) / 1e9}
        if "decode" in parts:
            r = run_batch(ex, model, 1, 128, 64, bw)
            row.update(decode_ms=r["ms_per_step"], decode_graph_ms=r["graph_ms"], decode_device_ms=r["device_ms"])
        if "ttft" in parts:
            row["prefill_1k_ms"] = ttft_ms(ex)
        return row
    finally:
        ex.close()


def serve_rows(fmt: str, folder: str, out: Path, tokenizer: str, scale: float) -> dict:
    quant = FORMATS[fmt][1]
    extra = ["--quantization", quant] if quant else []
    serve_out = out / "quantization-serve"
    serve_out.mkdir(parents=True, exist_ok=True)
    r = run_model(MODEL, ["c1", "inf"], serve_out, tokenizer, extra, folder=folder, scale=scale)
    c1, inf = r["c1"][0], r["inf"][0]
    return {"c1_median_ttft_ms": c1.get("median_ttft_ms"), "c1_median_tpot_ms": c1.get("median_tpot_ms"),
            "inf_output_throughput": inf.get("output_throughput")}


def ratios(rows: dict) -> dict:
    """Each format's figure over bf16's, with the issue's target where it names one."""
    base = rows.get("bf16", {})
    out = {}
    for fmt, row in rows.items():
        if fmt == "bf16":
            continue
        for key, value in row.items():
            if isinstance(value, (int, float)) and base.get(key):
                awq_decode = (fmt, key) == ("awq", "decode_ms")
                op, target = ("<=", AWQ_DECODE_TARGET) if awq_decode else TARGETS.get(key, ("", None))
                r = value / base[key]
                met = None if target is None else (r <= target if op == "<=" else r >= target)
                out.setdefault(fmt, {})[key] = {"ratio": r, "target": f"{op} {target}" if target else None, "met": met}
    return out


def report(result: dict) -> str:
    lines = [f"# Quantized weights vs bf16 ({MODEL}, random weights of the real shapes)", "",
             f"{result['date']}, {result['gpu']}, `{result['command']}`", "",
             "| format | figure | value | bf16 | ratio | target |", "| --- | --- | --- | --- | --- | --- |"]
    for fmt, figures in result["ratios"].items():
        for key, r in figures.items():
            met = "" if r["met"] is None else (" (met)" if r["met"] else " (NOT met)")
            lines.append(f"| {fmt} | {key} | {result['rows'][fmt][key]:.3f} | {result['rows']['bf16'][key]:.3f} | "
                         f"{r['ratio']:.3f} | {r['target'] or '-'}{met} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--parts", default="decode,ttft,serve")
    p.add_argument("--formats", default="bf16,fp8,fp8-dynamic,awq")
    p.add_argument("--scale", type=float, default=1.0, help="the serving scenarios' prompt counts scaled")
    p.add_argument("--weights-dir", default="/tmp")
    p.add_argument("--stem", default="quantization", help="output file names (a run split in parts: one stem each)")
    p.add_argument("--tokenizer",
                   default=os.environ.get("OPENINFER_TEST_TOKENIZER", "/work/shared/models/qwen-tokenizer"))
    args = p.parse_args(argv)
    import cupy
    out, parts = Path(args.out), args.parts.split(",")
    out.mkdir(parents=True, exist_ok=True)
    paths, bw = folders(args.weights_dir, args.formats.split(",")), copy_bandwidth()
    rows = {}
    for fmt in args.formats.split(","):
        rows[fmt] = executor_rows(fmt, paths[fmt], parts, bw) if {"decode", "ttft"} & set(parts) else {}
        if "serve" in parts:
            rows[fmt].update(serve_rows(fmt, paths[fmt], out, args.tokenizer, args.scale))
        print(f"[{fmt}] {json.dumps(rows[fmt])}", flush=True)
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "gpu": gpu,
              "command": "python bench/quantization.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "copy_bandwidth_gb_s": bw / 1e9, "rows": rows, "ratios": ratios(rows)}
    (out / f"{args.stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{args.stem}.md").write_text(report(result))
    print(report(result), flush=True)
    return result


if __name__ == "__main__":
    subprocess.run(["nvidia-smi", "-L"], check=False)
    main()
