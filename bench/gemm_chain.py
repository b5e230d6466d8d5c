"""A decoder layer's four projections chained as a decode step runs them: the weight stream in context.

    python3 bench/gemm_chain.py [--models 4B,8B] [--ms 1,8,32,64,128,192] [--out DIR]

Per layer: ``qkv = x·Wqkvᵀ``, ``h += attn·Woᵀ``, ``gu = x·Wguᵀ``, ``h += act·Wdownᵀ`` (the residual
adds fused, as the engine's CuTe path runs them), over rotating layers whose weights together
exceed L2, in a CUDA graph of 20 layers (median of 5 replays). Rows: the CuTe plan as launched
(programmatic dependent launches), the same with ``prefetch_weights`` (each GEMM's first weight
tiles load while the one before finishes), and cuBLAS through torch (plain ``mm``, the baseline).
µs per layer, the weight bytes streamed per µs, and that as a share of the measured device copy
bandwidth: the small-M GEMMs' HBM target seen as a decode sees it, launch gaps overlapped or not.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import (QWEN_SHAPES, ROTATE_BYTES, copy_bandwidth_gbs, gpu_info, graph_time_us,  # noqa: E402
                           torch_graph_us, write_report)
from openinfer_kernels.cute.gemm import A_ROW_PAD  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")
RESIDUAL = {"o", "down"}                   # accumulated into the residual stream h
INPUT = {"qkv": "x", "o": "attn", "gate_up": "x", "down": "act"}


class Layers:
    """Rotating layers of random bf16 weights and one set of activations (views of 256-row
    buffers, as the engine's arena holds them)."""

    def __init__(self, model: str, m: int):
        import cupy as cp

        from openinfer_kernels.cute.verification.checks import rand_bf16

        self.shapes = {p: QWEN_SHAPES[f"{model}.{p}"] for p in PROJECTIONS}  # (N, K)
        self.layer_bytes = sum(2 * n * k for n, k in self.shapes.values())
        self.sets = max(2, math.ceil(ROTATE_BYTES / self.layer_bytes))
        self.w = [{p: rand_bf16(nk) for p, nk in self.shapes.items()} for _ in range(self.sets)]
        rows = -(-m // A_ROW_PAD) * A_ROW_PAD
        widths = {"x": self.shapes["qkv"][1], "attn": self.shapes["o"][1], "act": self.shapes["down"][1]}
        self.inputs = {name: rand_bf16((rows, k))[:m] for name, k in widths.items()}
        self.out = {p: cp.zeros((m, self.shapes[p][0]), dtype=cp.uint16) for p in ("qkv", "gate_up")}
        self.h = cp.zeros((m, self.shapes["o"][0]), dtype=cp.uint16)

    def cute_layer(self, runner, i: int, stream, prefetch: bool) -> None:
        w = self.w[i % self.sets]
        for p in PROJECTIONS:
            out = self.h if p in RESIDUAL else self.out[p]
            runner(self.inputs[INPUT[p]], w[p], out, stream=stream, residual=out if p in RESIDUAL else None,
                   prefetch_weights=prefetch)


def cublas_layer_us(layers: Layers) -> float:
    """The same chain as four torch.mm per layer (no fused residual: the baseline's GEMMs alone)."""
    import torch

    w = [{p: torch.randn(*nk, device="cuda", dtype=torch.bfloat16) for p, nk in layers.shapes.items()}
         for _ in range(layers.sets)]
    m = layers.h.shape[0]
    inputs = {name: torch.randn(m, t.shape[1], device="cuda", dtype=torch.bfloat16) for name, t in layers.inputs.items()}
    outs = {p: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for p, (n, _) in layers.shapes.items()}

    def layer(i):
        for p in PROJECTIONS:
            torch.mm(inputs[INPUT[p]], w[i % layers.sets][p].t(), out=outs[p])

    us = torch_graph_us(layer)
    w = inputs = outs = None  # freed before the cache is emptied
    torch.cuda.empty_cache()
    return us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="4B,8B")
    parser.add_argument("--ms", default="1,8,32,64,128,192")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args()

    import cupy as cp

    from openinfer_kernels.cute.gemm import GemmRunner

    runner = GemmRunner()
    runner.init()
    hbm = copy_bandwidth_gbs()
    lines = [f"# GEMM chain, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {gpu_info()}",
             f"device copy bandwidth {hbm:.0f} GB/s", "",
             "| model | M | weights/layer MB | CuTe µs | +prefetch µs | cuBLAS µs | best CuTe GB/s | %copy | cuBLAS/CuTe |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        for m in (int(x) for x in args.ms.split(",")):
            layers = Layers(model, m)
            runner.reserve_workspace(m, layers.shapes.values())
            plain = graph_time_us(lambda i, s: layers.cute_layer(runner, i, s, False), layers.sets, f"{model} M={m}")
            early = graph_time_us(lambda i, s: layers.cute_layer(runner, i, s, True), layers.sets, f"{model} M={m} +pf")
            base = cublas_layer_us(layers)
            best = min(plain, early)
            gbs = layers.layer_bytes / best / 1e3
            lines.append(f"| {model} | {m} | {layers.layer_bytes / 1e6:.0f} | {plain:.1f} | {early:.1f} | {base:.1f} | "
                         f"{gbs:.0f} | {100 * gbs / hbm:.0f} | {base / best:.2f} |")
            print(lines[-1], flush=True)
            layers = None  # freed before the pool is emptied
            cp.get_default_memory_pool().free_all_blocks()
    write_report(args.out, "gemm_chain.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
