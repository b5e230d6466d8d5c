"""StepTimer: each step's GPU time from CUDA events around its work on the stream (options.time_steps)."""
from __future__ import annotations

import collections


class StepTimer:
    """CUDA events around each step's work on the stream: its GPU time, with no sync of its own. Steps
    are read in the order they were queued (two may be in flight), so the pairs wait in a queue."""

    def __init__(self, stream):
        self.stream = stream
        self.pairs: collections.deque = collections.deque()

    def start(self) -> None:
        import cupy

        begin = cupy.cuda.Event()
        begin.record(self.stream)
        self.pairs.append([begin, None])

    def stop(self) -> None:
        import cupy

        self.pairs[-1][1] = end = cupy.cuda.Event()
        end.record(self.stream)

    def clear(self) -> None:
        """Forget the steps queued: they failed, and none will be read."""
        self.pairs.clear()

    def elapsed_ms(self) -> float | None:
        import cupy

        if not self.pairs:
            return None
        begin, end = self.pairs.popleft()
        end.synchronize()
        return float(cupy.cuda.get_elapsed_time(begin, end))
