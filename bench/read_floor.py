"""What one kernel that only reads a weight-sized buffer takes: the floor under a small-M GEMM.

    python3 bench/read_floor.py [--mb 21,31,50,...] [--out DIR]

A raw CUDA kernel streams ``bytes`` of a buffer with 16-byte loads (grid-stride over about two
CTAs per SM, an xor per thread, one word out per CTA) and does nothing else: no tensor work, no
epilogue, no reduction. Timed like the GEMMs of ``bench/kernels.py``: a CUDA graph of 20 launches
over rotating copies (together > L2), median of 5 replays. Two rows per size:
- ``serial``: plain launches, each waits for the one before to finish (a kernel boundary's full
  ramp and tail);
- ``pdl``: programmatic dependent launches whose loads go out before ``griddepcontrol.wait``, so a
  launch streams while the one before drains (what ``prefetch_weights`` aims at).
A GEMM of the same weight bytes cannot beat ``serial`` by much in isolation; the share of the copy
bandwidth it reaches is the ceiling for the small-M HBM target at that size.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import (QWEN_SHAPES, ROTATE_BYTES, copy_bandwidth_gbs, gpu_info, graph_time_us,  # noqa: E402
                           write_report)

READ_SOURCE = r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ src, long long n16, unsigned* __restrict__ out,
                                       int early) {
    unsigned acc = 0;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    if (!early) asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    #pragma unroll 4
    for (; i < n16; i += step) {
        uint4 v = __ldg(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (early) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;  // (practically never: keeps the loads alive)
}
"""
CTAS_PER_SM = 2
THREADS = 512


def read_floor_us(nbytes: int, pdl: bool) -> float:
    """Median µs per launch of the read-only stream over ``nbytes`` (see the module docstring)."""
    import cupy as cp
    import numpy as np

    from openinfer_kernels.raw_cuda.launch import launch

    kernel = cp.RawModule(code=READ_SOURCE, options=("-std=c++17",)).get_function("read_stream")
    sets = max(2, -(-ROTATE_BYTES // nbytes))
    bufs = [cp.ones(nbytes // 4, dtype=cp.uint32) for _ in range(sets)]
    out = cp.zeros(1024, dtype=cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    n16 = np.int64(nbytes // 16)

    def run(i, stream):
        launch(kernel, (CTAS_PER_SM * sms,), (THREADS,), (bufs[i], n16, out, np.int32(pdl)), stream, pdl=pdl)

    try:
        return graph_time_us(run, sets, f"read {nbytes >> 20} MiB{' pdl' if pdl else ''}")
    finally:
        bufs = None
        cp.get_default_memory_pool().free_all_blocks()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", default="", help="sizes in MB (default: the Qwen3-4B/8B projection weights)")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args()
    hbm = copy_bandwidth_gbs()
    names = {2 * n * k: name for name, (n, k) in QWEN_SHAPES.items()}
    lines = [f"# Read floor, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {gpu_info()}",
             f"device copy bandwidth {hbm:.0f} GB/s", "",
             "| bytes (MB) | weight | serial µs | %copy | pdl µs | %copy |", "|---|---|---|---|---|---|"]
    sizes = ([int(float(x) * 1e6) // 16 * 16 for x in args.mb.split(",")] if args.mb
             else sorted({2 * n * k for n, k in QWEN_SHAPES.values()}))
    for nbytes in sizes:
        serial, early = read_floor_us(nbytes, False), read_floor_us(nbytes, True)
        share = [100 * nbytes / us / 1e3 / hbm for us in (serial, early)]
        lines.append(f"| {nbytes / 1e6:.1f} | {names.get(nbytes, '')} | {serial:.1f} | {share[0]:.0f} | "
                     f"{early:.1f} | {share[1]:.0f} |")
        print(lines[-1], flush=True)
    write_report(args.out, "read_floor.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
