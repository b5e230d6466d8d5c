"""Streams, events and pinned host buffers the GPU executor works with."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def pinned_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A page-locked host array (fast, asynchronous host<->device copies)."""
    import cupy

    dtype = np.dtype(dtype)
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape)


@dataclass
class DeviceStreams:
    """`compute` runs the model, `copy` uploads weights / moves KV; events order them."""
    compute: object = field(default=None)
    copy: object = field(default=None)

    def __post_init__(self):
        import cupy

        self.compute = self.compute or cupy.cuda.Stream(non_blocking=True)
        self.copy = self.copy or cupy.cuda.Stream(non_blocking=True)

    def event(self):
        import cupy

        return cupy.cuda.Event(block=False, disable_timing=True)
