"""Load the GPU from another process while correctness tests run (bench/gpu_all_check.sh with
GPU_LOAD=1): bf16-sized matrix products and device copies on a stream of this process's own, back to
back, until killed or --seconds pass. Timing-dependent bugs (a launch not ordered after the upload it
reads, a buffer read before its write) show up under such load; the kernels' results must not change.

    python3 bench/gpu_load.py [--seconds S] [--mib M]
"""
from __future__ import annotations

import argparse
import time

import cupy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3600.0)
    ap.add_argument("--mib", type=int, default=1024, help="size of each copy buffer")
    args = ap.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        a = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32).astype(cupy.float16)
        src = cupy.zeros(args.mib << 18, cupy.float32)
        dst = cupy.empty_like(src)
    end, rounds = time.monotonic() + args.seconds, 0
    while time.monotonic() < end:
        with stream:
            for _ in range(8):
                a = (a @ a) * cupy.float16(1e-3)
                dst[...] = src
        stream.synchronize()
        rounds += 1
    print(f"gpu_load: {rounds} rounds")


if __name__ == "__main__":
    main()
