"""Does a bulk host<->device copy delay a step's small copies? The latency of a small copy (a step's
uploaded inputs or its read-back ids) on one stream while a bulk copy (a host-tier restore or offload)
runs on another, against the same copy alone, and against a kernel that moves the same bytes through
pinned host memory mapped into the device's address space (no copy engine).

    python3 bench/copy_contention.py [--bulk-mib 1024 --small-kib 4 --repeats 5]

Prints one markdown row per (bulk direction, small transfer): the wall time from enqueueing the small
transfer to its event completing (what the engine's step waits for), median of the repeats.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

MAPPED_COPY = r"""
extern "C" __global__ void mapped_copy(const int* __restrict__ src, int* __restrict__ dst, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def pinned(nbytes: int) -> np.ndarray:
    import cupy
    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, np.uint8, nbytes)


def main(argv=None) -> list[dict]:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bulk-mib", type=int, default=1024)
    p.add_argument("--small-kib", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    rt = cupy.cuda.runtime
    bulk_n, small_n = args.bulk_mib << 20, args.small_kib << 10
    bulk_host, bulk_dev = pinned(bulk_n), cupy.empty(bulk_n, cupy.uint8)
    small_host, small_dev = pinned(small_n), cupy.zeros(small_n, cupy.uint8)
    kernel = cupy.RawKernel(MAPPED_COPY, "mapped_copy")
    bulk_stream, step_stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    bulk_kinds = {"none": None, "D2H": (bulk_host.ctypes.data, bulk_dev.data.ptr, rt.memcpyDeviceToHost),
                  "H2D": (bulk_dev.data.ptr, bulk_host.ctypes.data, rt.memcpyHostToDevice)}
    n_int = small_n // 4

    def small(kind: str) -> None:
        s = step_stream.ptr
        if kind == "copy H2D":
            rt.memcpyAsync(small_dev.data.ptr, small_host.ctypes.data, small_n, rt.memcpyHostToDevice, s)
        elif kind == "copy D2H":
            rt.memcpyAsync(small_host.ctypes.data, small_dev.data.ptr, small_n, rt.memcpyDeviceToHost, s)
        elif kind == "kernel H2D (mapped)":
            kernel((4,), (256,), (np.uint64(small_host.ctypes.data), small_dev, np.int64(n_int)), stream=step_stream)
        else:
            kernel((4,), (256,), (small_dev, np.uint64(small_host.ctypes.data), np.int64(n_int)), stream=step_stream)

    rows = []
    for bulk, spec in bulk_kinds.items():
        for kind in ("copy H2D", "copy D2H", "kernel H2D (mapped)", "kernel D2H (mapped)"):
            small(kind)
            step_stream.synchronize()
            waits, bulk_ms = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                if spec is not None:
                    rt.memcpyAsync(spec[0], spec[1], bulk_n, spec[2], bulk_stream.ptr)
                time.sleep(0.0005)                    # the bulk copy is running when the step's transfer is queued
                t1 = time.perf_counter()
                done = cupy.cuda.Event(disable_timing=True)
                small(kind)
                done.record(step_stream)
                done.synchronize()
                waits.append((time.perf_counter() - t1) * 1e3)
                bulk_stream.synchronize()
                bulk_ms.append((time.perf_counter() - t0) * 1e3)
            rows.append(dict(bulk=bulk, small=kind, wait_ms=float(np.median(waits)), bulk_ms=float(np.median(bulk_ms))))
    print(f"| bulk copy ({args.bulk_mib} MiB) | small transfer ({args.small_kib} KiB) | its wait ms (median) "
          f"| bulk copy wall ms |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['bulk']} | {r['small']} | {r['wait_ms']:.3f} | {r['bulk_ms']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
