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


class PinnedTwins:
    """Pinned host buffers used in turn to stage uploads queued on a stream (a copy, or a kernel reading the
    buffer through its mapping). One is rewritten only once the upload that last read it has run: `take()`
    waits on the event `sent()` recorded behind that upload. The host may run steps ahead of the device (async
    scheduling; an eager step that samples nothing returns without waiting for the GPU), so how many uploads are
    still queued is not bounded by the buffers' count, and a buffer rewritten early feeds a queued step another
    step's inputs."""

    def __init__(self, shape: tuple[int, ...], dtype, count: int = 2):
        self.buffers = [pinned_array(shape, dtype) for _ in range(count)]
        self.events: list = [None] * count
        self.turn = count - 1

    @property
    def current(self) -> np.ndarray:
        return self.buffers[self.turn]

    def take(self) -> np.ndarray:
        """The next buffer, once the upload that last read it has run."""
        self.turn = (self.turn + 1) % len(self.buffers)
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
        return self.buffers[self.turn]

    def sent(self, stream) -> None:
        """Mark the current buffer's upload queued on `stream` (call right after queuing it)."""
        import cupy

        if self.events[self.turn] is None:
            self.events[self.turn] = cupy.cuda.Event(block=False, disable_timing=True)
        self.events[self.turn].record(stream)
