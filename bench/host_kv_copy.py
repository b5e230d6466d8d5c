"""Host KV tier copy speed on the GPU: offload (device blocks -> pinned slots) and restore of N blocks
through memory/host_kv_copy.py, against one plain bulk copy of the same bytes (the link's roofline).

    python3 bench/host_kv_copy.py [--layers 36 --kv-heads 8 --head-dim 128 --blocks 1024 --slots 512]

Prints one markdown row per (N, pattern): "runs" moves blocks 0..N-1 to slots 0..N-1 (one 2D copy),
"scattered" moves N random blocks to N random slots (one 2D copy per block). Times are CUDA-event
medians of 5 repeats; host µs is the time to enqueue one copy_blocks call.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from engine.batch import BLOCK_SIZE
from memory.host_kv_copy import gpu_host_kv_copy


def timed(stream, fn, repeats: int = 5) -> tuple[float, float]:
    """(median GPU ms, median host µs to enqueue) of fn() on stream."""
    import cupy

    gpu, host = [], []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record(stream)
        end.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(gpu)), float(np.median(host))


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--counts", default="1,8,64,256")
    a = p.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    kv = cupy.zeros((a.layers, 2, a.blocks * BLOCK_SIZE, a.kv_heads, a.head_dim), cupy.uint16)
    copier = gpu_host_kv_copy(kv, a.slots, stream)
    mb = copier.block_bytes / 2**20
    print(f"pool {a.layers} layers x {a.kv_heads} KV heads x {a.head_dim}: block {mb:.3f} MiB, "
          f"chunk {copier.chunk} B, {a.blocks} blocks, {a.slots} pinned slots, max pitch {copier.max_pitch}")
    print("| N | pattern | offload ms | GB/s | restore ms | GB/s | bulk D2H GB/s | bulk H2D GB/s | host µs/call |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    rt = cupy.cuda.runtime
    for n in (int(x) for x in a.counts.split(",")):
        if n > min(a.blocks, a.slots):
            continue
        nbytes = n * copier.block_bytes
        bulk_d2h, _ = timed(stream, lambda: rt.memcpyAsync(copier.host.ctypes.data, kv.data.ptr, nbytes,
                                                           rt.memcpyDeviceToHost, stream.ptr))
        bulk_h2d, _ = timed(stream, lambda: rt.memcpyAsync(kv.data.ptr, copier.host.ctypes.data, nbytes,
                                                           rt.memcpyHostToDevice, stream.ptr))
        patterns = {"runs": (np.arange(n), np.arange(n)),
                    "scattered": (rng.permutation(a.blocks)[:n], rng.permutation(a.slots)[:n])}
        for name, (blocks, slots) in patterns.items():
            down = list(zip(blocks.tolist(), slots.tolist()))
            up = list(zip(slots.tolist(), blocks.tolist()))
            off_ms, off_us = timed(stream, lambda: copier.copy_blocks(down, []))
            res_ms, res_us = timed(stream, lambda: copier.copy_blocks([], up))
            gbs = lambda ms: nbytes / ms / 1e6                                         # noqa: E731
            print(f"| {n} | {name} | {off_ms:.3f} | {gbs(off_ms):.1f} | {res_ms:.3f} | {gbs(res_ms):.1f} | "
                  f"{gbs(bulk_d2h):.1f} | {gbs(bulk_h2d):.1f} | {max(off_us, res_us):.0f} |")


if __name__ == "__main__":
    main()
