"""A step's other cores for the numpy executor: a small persistent thread pool that runs the parts of one
piece of work (numpy releases the GIL in its copies, products and ufuncs, so two threads use two cores).

The engine process owns the machine's cores while a step runs (the server process waits on it), but the
BLAS library stays on one thread for decode-size steps (engine/executor/cpu_threads.py: its own split of a
skinny product waits on its slowest thread). So the work is split above BLAS instead, where a part is
large (a long context's attention, engine/executor/cpu_attention.py), each part computed exactly as one
thread computes it: the results do not depend on how many workers ran them."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

MAX_WORKERS = 4


class Workers:
    """`count` threads: run(part, parts) calls part(0), ..., part(parts - 1), part 0 on the calling thread and
    the others on the pool's, and returns once every part has ended (raising the first error)."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"workers must be >= 1, got {count}")
        self.count = count
        self._pool = ThreadPoolExecutor(count - 1, thread_name_prefix="numpy-worker") if count > 1 else None

    def run(self, part: Callable[[int], None], parts: int) -> None:
        parts = max(1, min(parts, self.count))
        futures = [self._pool.submit(part, w) for w in range(1, parts)] if parts > 1 else []
        try:
            part(0)
        finally:
            wait(futures)                   # no part still writing once this returns or raises
        for f in futures:
            f.result()


def share(items: int, part: int, parts: int) -> range:
    """Part `part` of `parts` contiguous, near-equal shares of range(items)."""
    return range(items * part // parts, items * (part + 1) // parts)
