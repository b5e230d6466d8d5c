"""Kept (quantized) routed experts' grouped product at prefill sizes, kernel by kernel. 4-bit: gemv_w4_grouped (the
decode GEMV, 16 rows at a time), w4_grouped_gemm.cu (64-row blocks), and the bf16 path it replaced where the CuTe
library is built (w4_dequant.cu of the experts, then the CuTe grouped GEMM on the bf16 weights). FP8 (block
scales): gemv_fp8_grouped, fp8_grouped_gemm.cu, and the CuTe bf16 grouped GEMM on bf16 weights of the same shape
(what the bf16 checkpoint would run); fp8_quant.cu of the rows, which both FP8 kernels need, timed apart.

Shapes: DeepSeek-V4-Flash's experts (top-6 of 256, FP4 e2m1 + ue8m0 scales per 32; gate_up 4096 x 4096, down
4096 x 2048), Kimi-K2-Thinking's (top-8 of 384, int4 + bf16 scales per 32; gate_up 4096 x 7168, down 7168 x 2048),
DeepSeek-V3's / Kimi-K2-Instruct's FP8 ones (top-8 of 256, gate_up 4096 x 7168, down 7168 x 2048) and
Qwen3-30B-A3B-FP8's (top-8 of 128, gate_up 1536 x 2048, down 2048 x 768). Each step of T tokens routes uniformly
at random; EXPERTS of the layer's experts are simulated with the rows an
expert gets at that T (T · top_k / experts each, moe_align's layout in tiles of 64 or 128), random codes made on
the device. Reported: µs of the EXPERTS' product and TFLOP/s (2 · rows · N · K over real rows). One CUDA event pair
around REPS calls after a warm-up; the first call compiles.

    python3 bench/experts_prefill.py [--tokens 128,512,2048,8192] [--models deepseek-v3-fp8,...] [--reps 5]
                                     [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.executor.gpu_moe_ops import expert_tile_m  # noqa: E402
from harness.quant_cases import grouped_layout  # noqa: E402
from openinfer_kernels.quant.ops import QuantOps, W4Weight  # noqa: E402

EXPERTS = 16
MODELS = {  # name: (experts, top_k, format, [(product, N, K)])
    "deepseek-v4-flash": (256, 6, "fp4", [("gate_up", 4096, 4096), ("down", 4096, 2048)]),
    "kimi-k2": (384, 8, "int4", [("gate_up", 4096, 7168), ("down", 7168, 2048)]),
    "deepseek-v3-fp8": (256, 8, "fp8", [("gate_up", 4096, 7168), ("down", 7168, 2048)]),
    "qwen3-30b-a3b-fp8": (128, 8, "fp8", [("gate_up", 1536, 2048), ("down", 2048, 768)]),
}


def random_experts(n: int, k: int, fp4: bool) -> W4Weight:
    """EXPERTS random 4-bit experts in gemv_w4.cu's layout on the device (scales 2^-6..2^-4: finite products)."""
    import cupy

    T, S, G = -(-n // 16), -(-k // 128), -(-k // 128) * 128 // 32
    codes = cupy.random.randint(0, 2 ** 31, (EXPERTS, T, S, 2, 32, 4), dtype=np.int64).astype(np.uint32)
    scales = cupy.random.randint(0x3C80, 0x3D80, (EXPERTS, T, G, 8, 2), dtype=np.int32).astype(np.uint16)
    defines = (("W4_FP4", int(fp4)), ("W4_SCALE_FP16", 0), ("W4_ZERO", 0))
    return W4Weight(codes, scales, None, n, k, 32, defines, EXPERTS)


def layout(tokens: int, top_k: int, experts: int, rng):
    """moe_align's layout of the EXPERTS' share of a step: (tile_m, tile_expert, row_token, real rows)."""
    tile_m = expert_tile_m(tokens, top_k, experts)
    counts = rng.multinomial(tokens * top_k, np.full(experts, 1 / experts))[:EXPERTS]
    return (tile_m, *grouped_layout(counts, tile_m), int(counts.sum()))


def timed_us(call, reps: int) -> float:
    import cupy

    call()
    cupy.cuda.Stream.null.synchronize()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    for _ in range(reps):
        call()
    e1.record()
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / reps


def w4_calls(ops, a, te, rt, y, tile_m: int, n: int, k: int, fp4: bool) -> dict:
    import cupy
    from openinfer_kernels import cute

    w = random_experts(n, k, fp4)
    calls = {"gemv_w4_grouped": lambda: ops.gemv_w4_grouped(a, w, te, rt, y, tile_m),
             "w4_grouped_gemm": lambda: ops.w4_grouped_gemm(a, w, te, rt, y, tile_m)}
    if cute.available():
        bf = cupy.empty((EXPERTS, n, k), np.uint16)
        calls["w4_dequant + cute grouped_gemm"] = lambda: (ops.dequant_w4(w, bf), cute.grouped_gemm(a, bf, te, y))
    return calls


def fp8_calls(ops, a, te, rt, y, tile_m: int, n: int, k: int) -> dict:
    """Block-scaled e4m3 experts (codes in [-2, 2): finite products); the rows quantized once beforehand."""
    import cupy
    from openinfer_kernels import cute

    codes = cupy.random.randint(0, 256, (EXPERTS, n, k), dtype=np.int32).astype(np.uint8) & 0xBF
    scales = cupy.full((EXPERTS, -(-n // 128), k // 128), 2.0 ** -4, np.float32)
    aq, sa = cupy.empty(a.shape, np.uint8), cupy.empty((k // 128, a.shape[0]), np.float32)
    ops.fp8_quant(a, aq, sa)
    calls = {"fp8_quant (the rows, both FP8 kernels)": lambda: ops.fp8_quant(a, aq, sa),
             "gemv_fp8_grouped": lambda: ops.gemv_fp8_grouped(aq, sa, codes, scales, te, rt, y, tile_m),
             "fp8_grouped_gemm": lambda: ops.fp8_grouped_gemm(aq, sa, codes, scales, te, rt, y, tile_m)}
    if cute.available():
        bf = cupy.random.randint(0x3C00, 0x3F80, (EXPERTS, n, k), dtype=np.int32).astype(np.uint16)
        calls["cute grouped_gemm on bf16 weights"] = lambda: cute.grouped_gemm(a, bf, te, y)
    return calls


def product_rows(model: str, tokens: int, reps: int, rng) -> list[dict]:
    import cupy

    experts, top_k, fmt, products = MODELS[model]
    tile_m, tile_expert, row_token, real = layout(tokens, top_k, experts, rng)
    te, rt = cupy.asarray(tile_expert), cupy.asarray(row_token)
    ops, out = QuantOps(None), []
    ops.pdl = False
    for name, n, k in products:
        a = cupy.random.randint(0x3C00, 0x3F80, (row_token.size, k), dtype=np.int32).astype(np.uint16)
        y = cupy.empty((row_token.size, n), np.uint16)
        calls = (fp8_calls(ops, a, te, rt, y, tile_m, n, k) if fmt == "fp8"
                 else w4_calls(ops, a, te, rt, y, tile_m, n, k, fmt == "fp4"))
        for kernel, call in calls.items():
            us = timed_us(call, reps)
            out.append(dict(model=model, tokens=tokens, product=name, kernel=kernel, rows=real, us=round(us, 1),
                            tflops=round(2 * real * n * k / us / 1e6, 1)))
            print(out[-1], flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="128,512,2048,8192")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = [r for m in args.models.split(",") for t in map(int, args.tokens.split(","))
            for r in product_rows(m, t, args.reps, rng)]
    keys = ("model", "tokens", "product", "kernel", "rows", "us", "tflops")
    lines = ["| model | tokens | product | kernel | rows | µs | TFLOP/s |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "experts-prefill.json").write_text(json.dumps(rows, indent=1))
        (args.out / "experts-prefill.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
