"""Weight upload: host arrays (safetensors memory maps) -> pinned staging -> device arena, at link speed.

Each weight is cut into copies of at most STAGING_BYTES (whole rows). Worker threads fill a ring of
pinned staging buffers from the memory-mapped file (numpy copies drop the GIL) while the copy stream
moves the filled ones to the device, in order; a buffer is refilled once the event after its last
copy has passed. A weight packed from several checkpoint tensors (PackedWeight: qkv, gate_up) is never
concatenated on the host: each part goes straight to its rows. A weight named for row interleaving
(gate_up for gemv.cu's fused SiLU·up) is laid out on the way: part p's rows in blocks of 8 land at
rows 16·b + 8·p + r of the device array, one strided (2D) copy per chunk. Values are converted to
bf16 in the workers where the checkpoint holds another float type; the device keeps bf16 as uint16.
Roofline: pinned host-to-device copies, ~54 GB/s on the H200's host; page-cache reads into staging
take the host's memory bandwidth, shared by the workers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from memory.device_arena import DeviceArena
from memory.packed_weight import PackedWeight
from memory.streams import DeviceStreams, pinned_array

log = logging.getLogger(__name__)
STAGING_BYTES = 64 << 20
WORKERS = 4
INTERLEAVE_ROWS = 8


@dataclass(frozen=True)
class Copy:
    """`height` rows of `width` bytes from src (consecutive rows, host) to dst (rows dst_pitch apart)."""
    src: np.ndarray             # the host rows (any float dtype; converted to bf16 when staged)
    dst: int
    dst_pitch: int
    width: int
    height: int

    @property
    def nbytes(self) -> int:
        return self.width * self.height


def copies_of(parts: list[np.ndarray], dst: int, interleave: bool, max_bytes: int = STAGING_BYTES) -> list[Copy]:
    """The copies that put `parts` (stacked along dim 0) at device address dst, bf16: rows in order,
    or with interleave (two parts of equal rows, a multiple of 8) in blocks of 8 alternating."""
    if interleave and (len(parts) != 2 or parts[0].shape != parts[1].shape or parts[0].shape[0] % INTERLEAVE_ROWS):
        raise ValueError(f"row interleave needs two parts of equal rows, a multiple of {INTERLEAVE_ROWS}: "
                         f"{[p.shape for p in parts]}")
    out, at = [], dst
    for p, part in enumerate(parts):
        rows = part.reshape(part.shape[0], -1) if part.ndim > 1 else part.reshape(1, -1)
        row_bytes = rows.shape[1] * 2
        if interleave:
            block = INTERLEAVE_ROWS * row_bytes
            per = max(1, max_bytes // block)
            for b0 in range(0, rows.shape[0] // INTERLEAVE_ROWS, per):
                n = min(per, rows.shape[0] // INTERLEAVE_ROWS - b0)
                src = rows[b0 * INTERLEAVE_ROWS:(b0 + n) * INTERLEAVE_ROWS]
                out.append(Copy(src, dst + (2 * b0 + p) * block, 2 * block, block, n))
        else:
            per = max(1, max_bytes // row_bytes)
            for r in range(0, rows.shape[0], per):
                src = rows[r:r + per]
                width = src.shape[0] * row_bytes
                out.append(Copy(src, at + r * row_bytes, width, width, 1))
        at += rows.shape[0] * row_bytes    # parts of a vector differ in length: advance by bytes
    return out


def weight_copies(w, dst: int, interleave: bool) -> list[Copy]:
    """The copies of one weight (an array or a PackedWeight) to dst; interleave: gate_up's halves in
    blocks of 8 rows, per expert for a stacked [experts, 2I, H] weight."""
    packed = isinstance(w, PackedWeight)
    if not interleave:
        return copies_of(list(w.parts) if packed else [w], dst, False)
    if packed and w.ndim == 2:
        return copies_of(list(w.parts), dst, True)
    experts = [w] if w.ndim == 2 else [w[e] for e in range(w.shape[0])]
    per = int(np.prod(experts[0].shape)) * 2
    half = experts[0].shape[0] // 2
    return [c for e, x in enumerate(experts) for c in copies_of([x[:half], x[half:]], dst + e * per, True)]


def stage(copy: Copy, buffer: np.ndarray) -> None:
    """The copy's rows as bf16 bits into the head of a staging buffer (a worker thread)."""
    src = copy.src
    if src.dtype.name != "bfloat16":
        src = src.astype(ml_dtypes.bfloat16)
    np.copyto(buffer[:copy.nbytes], np.ascontiguousarray(src).reshape(-1).view(np.uint8))


def upload_weights(arena: DeviceArena, weights: Iterable[tuple[str, np.ndarray]], streams: DeviceStreams,
                   total_bytes: int | None = None, progress: bool = True,
                   interleave: Callable[[str], bool] = lambda name: False, workers: int = WORKERS,
                   extra_rows: Callable[[str], int] = lambda name: 0, extended: dict | None = None) -> dict:
    """Copy every (name, array or PackedWeight) into the arena as bf16; returns name -> CuPy uint16 array.
    extra_rows(name) > 0: the weight's buffer has that many rows after its own (LoRA's A slots), the
    name maps to its first rows and ``extended[name]`` to the whole buffer."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    out, copies = {}, []
    for name, w in weights:
        extra = extra_rows(name)
        dev = arena.take(f"weights.{name}", (w.shape[0] + extra, *w.shape[1:]), np.uint16)
        if extra:
            extended[name] = dev
            dev = dev[: w.shape[0]]
        out[name] = dev
        copies += weight_copies(w, dev.data.ptr, interleave(name))
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="weights -> GPU", disable=not progress)
    ring = [pinned_array((STAGING_BYTES,), np.uint8) for _ in range(workers + 2)]
    done = [streams.event() for _ in ring]
    used = [False] * len(ring)

    def fill(i: int):
        b = i % len(ring)
        if used[b]:
            done[b].synchronize()             # the copy that last read this buffer has finished
        stage(copies[i], ring[b])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {i: pool.submit(fill, i) for i in range(min(len(ring), len(copies)))}
        for i, c in enumerate(copies):
            futures.pop(i).result()
            b = i % len(ring)
            _copy_2d(c, ring[b], streams.copy)
            done[b].record(streams.copy)
            used[b] = True
            if i + len(ring) < len(copies):
                futures[i + len(ring)] = pool.submit(fill, i + len(ring))
            bar.update(c.nbytes)
    streams.copy.synchronize()
    bar.close()
    moved, seconds = sum(c.nbytes for c in copies), time.perf_counter() - t0
    log.info("weights: %.2f GB to the device in %.2f s (%.1f GB/s)", moved / 1e9, seconds, moved / 1e9 / max(seconds, 1e-9))
    return out


def _copy_2d(c: Copy, staging: np.ndarray, stream) -> None:
    import cupy

    rt = cupy.cuda.runtime
    if c.height == 1:
        rt.memcpyAsync(c.dst, staging.ctypes.data, c.width, rt.memcpyHostToDevice, stream.ptr)
    else:
        rt.memcpy2DAsync(c.dst, c.dst_pitch, staging.ctypes.data, c.width, c.width, c.height,
                         rt.memcpyHostToDevice, stream.ptr)
