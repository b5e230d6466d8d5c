"""Quantized-weight kernels on the GPU against the bf16 ones, on Qwen3-8B's projection shapes, with rooflines.

Decode (M = 1, 8, 16): per projection, µs per call of gemv.cu (bf16 weights), cuBLAS (bf16), gemv_w4.cu in
each 4-bit format (AWQ-like fp16 scales + zeros, compressed-tensors bf16 scales, FP4) and its prefill
dequantization to bf16 (w4_dequant.cu), gemv_fp8.cu (block scales; its fp8_quant.cu of the activations
timed apart). Prefill (M = 512, 2048, 8192): the CuTe FP8 GEMM (the planned variant, then each 128-row
one by name) against cuBLAS bf16 and the CuTe bf16 GEMM (where built). Every kernel runs over a ring of distinct weight
copies (>= RING_BYTES, far beyond L2) captured in a CUDA graph, as a decode step streams its layers'
weights; the time is per call. Roofline: the bytes a call must move (weights + scales + x + y) over the
device-copy bandwidth measured in the same run (read + write); prefill also reports TFLOP/s.

    python3 bench/quant_kernels.py --out DIR [--rows 1,8,16] [--prefill 512,2048,8192] [--reps 10]
                                   [--w4-configs 1x2,1x3,2x2] [--fp8-configs 2x2,1x2]
                                   (gemv_w4.cu / gemv_fp8.cu CTA shapes side by side, the first the default)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.quant_cases import QWEN3_8B_SHAPES, random_fp8_weight, random_w4  # noqa: E402
from openinfer_kernels.quant.ops import QuantOps, GemvConfig, W4Weight  # noqa: E402
from openinfer_kernels.quant.w4_layout import pack_w4  # noqa: E402

RING_BYTES = 512 << 20
W4_FORMATS = {"w4 awq-like (fp16 + zeros, g128)": ("fp16_zero", 128), "w4 ct int4 (bf16, g32)": ("bf16", 32),
              "w4 fp4 (ue8m0, g32)": ("fp4", 32)}


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy rate, bytes read + written per second (bench/decode.py's measure)."""
    import cupy

    a, b = cupy.ones(nbytes, np.uint8), cupy.empty(nbytes, np.uint8)
    b[...] = a
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    for _ in range(reps):
        b[...] = a
    e1.record()
    e1.synchronize()
    return 2 * nbytes * reps / (cupy.cuda.get_elapsed_time(e0, e1) / 1e3)


def per_call_us(stream, calls, reps: int) -> float:
    """µs per call of `calls` (one closure per distinct weight copy), captured in one graph, replayed."""
    import cupy

    for call in calls[:2]:
        call()                                   # compile / load outside the capture
    stream.synchronize()
    stream.begin_capture()
    for call in calls:
        call()
    graph = stream.end_capture()
    graph.launch(stream)
    times = []
    for _ in range(reps):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        graph.launch(stream)
        e1.record(stream)
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / len(calls))
    return float(np.median(times))


def ring(nbytes: int) -> int:
    return max(4, -(-RING_BYTES // nbytes))


def rand_bf16(shape):
    """Random positive bf16 bits in [2^-7, 1), made on the device."""
    import cupy
    return cupy.random.randint(0x3c00, 0x3f80, shape, dtype=np.int32).astype(np.uint16)


def w4_copies(w: W4Weight) -> list[W4Weight]:
    """Distinct device copies of a 4-bit weight, RING_BYTES of them in all."""
    nbytes = w.codes.nbytes + w.scales.nbytes + (0 if w.zeros is None else w.zeros.nbytes)
    return [w] + [dataclasses.replace(w, codes=w.codes.copy(), scales=w.scales.copy(),
                                      zeros=None if w.zeros is None else w.zeros.copy())
                  for _ in range(ring(nbytes) - 1)]


def gemv_configs(spec: str) -> dict[str, GemvConfig]:
    """"RTxU,..." (16-row tiles a CTA x k steps in flight) -> a label suffix each ("" for a single one)."""
    configs = [GemvConfig(*map(int, c.split("x"))) for c in spec.split(",") if c]
    return {"" if len(configs) == 1 else f" [{c.tiles_per_cta}x{c.steps_in_flight}]": c for c in configs}


def decode_rows(stream, bw: float, rows_m, reps: int, w4: dict[str, GemvConfig],
                fp8: dict[str, GemvConfig]) -> list[dict]:
    import cupy

    from engine.executor.gpu_gemm import Gemm

    ops, blas, gemv = QuantOps(stream), Gemm(stream), Gemm(stream, gemv_max_m=32)
    w4_ops_by = {suffix: QuantOps(stream, w4=config) for suffix, config in w4.items()}
    fp8_ops_by = {suffix: QuantOps(stream, fp8=config) for suffix, config in fp8.items()}
    rng, out = np.random.default_rng(0), []
    for label, (N, K) in QWEN3_8B_SHAPES.items():
        bf16_w = [rand_bf16((N, K)) for _ in range(ring(N * K * 2))]
        w4_ws = {name: w4_copies(W4Weight.upload(pack_w4(random_w4(rng, kind, N, K, group))))
              for name, (kind, group) in W4_FORMATS.items()}
        w8, s8 = random_fp8_weight(rng, N, K, False)
        fp8_s = cupy.asarray(s8)
        fp8_w = [cupy.asarray(w8.view(np.uint8)) for _ in range(ring(N * K))]
        for M in rows_m:
            x = rand_bf16((M, K))
            y, xq, xs = cupy.empty((M, N), np.uint16), cupy.empty((M, K), np.uint8), cupy.empty((K // 128, M), np.float32)
            io = M * K * 2 + M * N * 2

            def add(kernel: str, us: float, nbytes: int) -> None:
                out.append(dict(proj=label, shape=f"{N}x{K}", M=M, kernel=kernel, us=us, roofline_us=nbytes / bw * 1e6))
            add("cuBLAS bf16", per_call_us(stream, [lambda w=w: blas(x, w, y) for w in bf16_w], reps), N * K * 2 + io)
            add("gemv.cu bf16", per_call_us(stream, [lambda w=w: gemv.gemv(x, w, y, pdl=True) for w in bf16_w], reps),
                N * K * 2 + io)
            for name, ws in w4_ws.items():
                nbytes = ws[0].codes.nbytes + ws[0].scales.nbytes + (0 if ws[0].zeros is None else ws[0].zeros.nbytes)
                for suffix, w4_ops in w4_ops_by.items():
                    add(name + suffix, per_call_us(stream, [lambda w=w, o=w4_ops: o.gemv_w4(x, w, y) for w in ws], reps),
                        nbytes + io)
                if M == rows_m[0]:          # prefill's bf16 weights (w4_dequant.cu), once per projection
                    scratch = cupy.empty((N, K), np.uint16)
                    add(name.replace("w4", "w4_dequant.cu to bf16", 1),
                        per_call_us(stream, [lambda w=w: ops.dequant_w4(w, scratch) for w in ws], reps),
                        nbytes + N * K * 2)
            add("fp8_quant.cu", per_call_us(stream, [lambda: ops.fp8_quant(x, xq, xs)] * 64, reps),
                M * K * 3 + M * K // 32)
            for suffix, fp8_ops in fp8_ops_by.items():
                add("gemv_fp8.cu (block scales)" + suffix,
                    per_call_us(stream, [lambda w=w, o=fp8_ops: o.gemv_fp8(xq, xs, w, fp8_s, y) for w in fp8_w], reps),
                    N * K + fp8_s.nbytes + M * K + M * N * 2)
        del bf16_w, w4_ws, fp8_w
    return out


def prefill_rows(stream, bw: float, rows_m, reps: int) -> list[dict]:
    import cupy

    from engine.executor.gpu_gemm import Gemm
    from openinfer_kernels import cute

    if not cute.available():
        print(f"[quant] prefill skipped: {cute.available().reason}", flush=True)
        return []
    from openinfer_kernels.cute.configs import FP8_GEMM_VARIANTS
    from openinfer_kernels.cute.gemm import GemmRunner, fp8_gemm

    runner, blas, out, rng = GemmRunner(), Gemm(stream), [], np.random.default_rng(1)
    for label, (N, K) in QWEN3_8B_SHAPES.items():
        w_bf16 = rand_bf16((N, K))
        w8, s8 = random_fp8_weight(rng, N, K, False)
        w8, s8 = cupy.asarray(w8.view(np.uint8)), cupy.asarray(s8)
        for M in rows_m:
            x = rand_bf16((M, K))
            xq, xs = cupy.empty((M, K), np.uint8), cupy.empty((K // 128, M), np.float32)
            y = cupy.empty((M, N), np.uint16)
            QuantOps(stream).fp8_quant(x, xq, xs)
            times = {"cuBLAS bf16": per_call_us(stream, [lambda: blas(x, w_bf16, y)] * 8, reps),
                     "CuTe bf16": per_call_us(stream, [lambda: runner(x, w_bf16, y, stream=stream)] * 8, reps),
                     "CuTe fp8 (block-scaled)": per_call_us(
                         stream, [lambda: fp8_gemm(runner, xq, xs, w8, s8, y, stream=stream)] * 8, reps)}
            for v in FP8_GEMM_VARIANTS:  # every 128-row tile beside the planned one: the data plan_fp8_gemm needs
                if v.tile_m == 128:
                    times[f"CuTe fp8 {v.name}"] = per_call_us(
                        stream, [lambda v=v: fp8_gemm(runner, xq, xs, w8, s8, y, stream=stream, variant=v)] * 8, reps)
            for kernel, us in times.items():
                nbytes = (M * K + N * K) * (1 if "fp8" in kernel else 2) + M * N * 2
                out.append(dict(proj=label, shape=f"{N}x{K}", M=M, kernel=kernel, us=us, roofline_us=nbytes / bw * 1e6,
                                tflops=2 * M * N * K / us / 1e6))
    return out


def table(rows: list[dict], bw: float) -> list[str]:
    lines = [f"device-copy bandwidth (read + write): {bw / 1e12:.2f} TB/s; roofline = bytes a call moves / it", "",
             "| proj | N x K | M | kernel | µs | roofline µs | fraction | TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['proj']} | {r['shape']} | {r['M']} | {r['kernel']} | {r['us']:.1f} | {r['roofline_us']:.1f} | "
                     f"{r['roofline_us'] / r['us']:.2f} | {r.get('tflops', float('nan')):.0f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--prefill", default="512,2048,8192")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--w4-configs", default="1x2", help="gemv_w4.cu CTA shapes to time, RTxU,...: 16-row "
                        "tiles a CTA x k steps in flight (ops.GemvConfig; the first is the default)")
    parser.add_argument("--fp8-configs", default="2x2", help="gemv_fp8.cu CTA shapes to time, as --w4-configs")
    args = parser.parse_args(argv)
    import cupy

    args.out.mkdir(parents=True, exist_ok=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    bw = copy_bandwidth()
    with stream:
        rows = decode_rows(stream, bw, [int(m) for m in args.rows.split(",") if m], args.reps,
                           gemv_configs(args.w4_configs), gemv_configs(args.fp8_configs))
        rows += prefill_rows(stream, bw, [int(m) for m in args.prefill.split(",") if m], args.reps)
    lines = table(rows, bw)
    (args.out / "quant_kernels.md").write_text("\n".join(lines) + "\n")
    (args.out / "quant_kernels.json").write_text(json.dumps(dict(copy_bandwidth=bw, rows=rows), indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
