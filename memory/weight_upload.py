"""Weight upload: host arrays (safetensors mmap) -> pinned staging -> device arena, overlapped.

Two pinned staging buffers alternate: while the copy stream moves buffer A to the device, the host
fills buffer B from the memory-mapped file. A tqdm bar counts bytes.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from memory.device_arena import DeviceArena
from memory.streams import DeviceStreams, pinned_array

STAGING_BYTES = 64 << 20


def device_dtype(a: np.ndarray) -> np.dtype:
    """bf16 (ml_dtypes) is stored on the device as its raw uint16 bits; other dtypes as they are."""
    return np.dtype(np.uint16) if a.dtype.name == "bfloat16" else a.dtype


def upload_weights(arena: DeviceArena, weights: Iterable[tuple[str, np.ndarray]], streams: DeviceStreams,
                   total_bytes: int | None = None, progress: bool = True) -> dict:
    """Copy every (name, array) into the arena; returns name -> CuPy array (bf16 as uint16)."""
    from tqdm import tqdm

    staging = [pinned_array((STAGING_BYTES,), np.uint8) for _ in range(2)]
    done = [None, None]                       # event per staging buffer: its last copy finished
    out = {}
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="weights -> GPU", disable=not progress)
    which = 0
    for name, host in weights:
        host = np.ascontiguousarray(host)
        dev = arena.take(f"weights.{name}", host.shape, device_dtype(host))
        src = host.reshape(-1).view(np.uint8)
        dst_ptr = dev.data.ptr
        for start in range(0, src.nbytes, STAGING_BYTES):
            chunk = src[start:start + STAGING_BYTES]
            if done[which] is not None:
                done[which].synchronize()     # the copy that last used this buffer has finished
            staging[which][:chunk.nbytes] = chunk
            _copy_async(dst_ptr + start, staging[which], chunk.nbytes, streams.copy)
            done[which] = streams.event()
            done[which].record(streams.copy)
            which ^= 1
            bar.update(chunk.nbytes)
        out[name] = dev
    streams.copy.synchronize()
    bar.close()
    return out


def _copy_async(dst_ptr: int, src: np.ndarray, nbytes: int, stream) -> None:
    import cupy

    cupy.cuda.runtime.memcpyAsync(dst_ptr, src.ctypes.data, nbytes,
                                  cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
