"""Does a bulk host<->device copy delay a step's small copies? The latency of a small copy (a step's
uploaded inputs or its read-back ids) on one stream while a bulk copy (a host-tier restore or offload)
runs on another, against the same copy alone, and against a kernel that moves the same bytes through
pinned host memory mapped into the device's address space (no copy engine).

    python3 bench/copy_contention.py [--bulk-mib 1024 --small-kib 4 --repeats 5]

Prints one markdown row per (bulk direction, small transfer): the wall time from enqueueing the small
transfer to its event completing (what the engine's step waits for), median of the repeats. Then the
layer-by-layer overlap a host-tier restore relies on: the bulk copy as --layers 2D copies host -> device
(an event after each) on one stream, and on another a forward of --layers spin kernels (--layer-us each)
whose layer l first waits for event l: the forward should end one layer after the copy, not a forward later.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""
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
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--layer-us", type=float, default=130.0)
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
    layered_overlap(bulk_host, bulk_dev, bulk_stream, step_stream, small_host, small_dev, args)
    return rows


def layered_overlap(bulk_host, bulk_dev, copy_stream, compute, small_host, small_dev, args) -> None:
    """The restore's layer-by-layer copy beside a forward that waits per layer (ms, median of repeats)."""
    import cupy

    rt, L = cupy.cuda.runtime, args.layers
    spin = cupy.RawKernel(SPIN, "spin")
    cycles = np.int64(args.layer_us * cupy.cuda.runtime.deviceGetAttribute(13, 0) / 1e3)   # clock rate in kHz
    rows, pitch = 2 * L, (bulk_host.nbytes // (2 * L)) // 256 * 256
    width = pitch // 2                        # half of each row: the 2D copies are strided, like the tier's

    def run(copy: bool, forward: bool, upload: bool, d2d: bool = False) -> float:
        t0 = cupy.cuda.Event()
        t0.record(compute)
        copy_stream.wait_event(t0)
        events = []
        if copy:
            for layer in range(L):
                rt.memcpy2DAsync(bulk_dev.data.ptr + 2 * layer * pitch, pitch, bulk_host.ctypes.data + 2 * layer * pitch,
                                 pitch, width, 2, rt.memcpyHostToDevice, copy_stream.ptr)
                events.append(cupy.cuda.Event(disable_timing=True))
                events[-1].record(copy_stream)
        if upload:
            rt.memcpyAsync(small_dev.data.ptr, small_host.ctypes.data, small_host.nbytes, rt.memcpyHostToDevice,
                           compute.ptr)
        for layer in range(L if forward else 0):
            spin((1,), (32,), (cycles // 2,), stream=compute)
            if copy:
                compute.wait_event(events[layer])
            if d2d and layer == 0:
                rt.memcpyAsync(small_dev.data.ptr + small_dev.nbytes // 2, small_dev.data.ptr, small_dev.nbytes // 2,
                               rt.memcpyDeviceToDevice, compute.ptr)
            spin((1,), (32,), (cycles // 2,), stream=compute)
        if copy:
            compute.wait_event(events[-1])
        t1 = cupy.cuda.Event()
        t1.record(compute)
        t1.synchronize()
        return cupy.cuda.get_elapsed_time(t0, t1)

    print(f"\nlayer-by-layer restore: {L} layers, {rows} rows of {width >> 20} MiB, forward {args.layer_us} µs a layer")
    print("| case | ms (median) |")
    print("|---|---|")
    for name, kw in (("copy alone", dict(copy=True, forward=False, upload=False)),
                     ("forward alone", dict(copy=False, forward=True, upload=False)),
                     ("copy + forward waiting per layer", dict(copy=True, forward=True, upload=False)),
                     ("same, the forward's inputs uploaded first (H2D)", dict(copy=True, forward=True, upload=True)),
                     ("same, a device-to-device memcpy in layer 0", dict(copy=True, forward=True, upload=False,
                                                                         d2d=True))):
        run(**kw)
        print(f"| {name} | {np.median([run(**kw) for _ in range(args.repeats)]):.2f} |")


if __name__ == "__main__":
    main()
