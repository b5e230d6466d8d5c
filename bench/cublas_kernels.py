"""Which kernel cuBLAS (through torch, the baseline of bench/kernels.py) runs for a GEMM shape.

    python3 bench/cublas_kernels.py [--shapes 4B.o,4B.down] [--ms 512,2048]

Prints, per Qwen3 projection shape and M, the CUDA kernels one ``torch.mm`` launches (name, grid,
block, µs) from the torch profiler; the names carry cuBLAS's tile, cluster and split-K / stream-K
choice, which is what the CuTe plan competes with. Baseline only: torch is not an engine dependency.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import QWEN_SHAPES  # noqa: E402


def kernels_of(m: int, n: int, k: int) -> list[tuple[str, str, float]]:
    """(name, grid x block, µs) of the kernels one ``torch.mm`` ran, after warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, w.t())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.mm(a, w.t())
        torch.cuda.synchronize()
    rows = []
    for event in prof.events():
        if event.device_type.name == "CUDA":
            shape = ""
            if hasattr(event, "kwinputs") and event.kwinputs:
                shape = f"grid {event.kwinputs.get('grid')} block {event.kwinputs.get('block')}"
            rows.append((event.name, shape, event.device_time))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4B.o,4B.down,4B.gate_up,8B.down")
    parser.add_argument("--ms", default="512,2048")
    args = parser.parse_args()
    for name in args.shapes.split(","):
        n, k = QWEN_SHAPES[name]
        for m in map(int, args.ms.split(",")):
            for kernel, shape, us in kernels_of(m, n, k):
                print(f"{name} M={m}: {us:7.1f} µs  {kernel[:160]} {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
