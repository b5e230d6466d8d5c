"""The CPU executor's BLAS threads, set through OpenBLAS's own openblas_set_num_threads (ctypes: no
dependency added), on numpy's bundled OpenBLAS or a system one.

numpy's OpenBLAS starts one thread per core and splits every product over all of them. A product then
waits for its slowest thread, and on a machine whose cores also run anything else (the HTTP server
process, other programs) that thread is often not running: on the 2-core machine, loaded by other
work, SmolLM2's 1536 x 576 product took 0.15-0.4 ms on one thread and 1.4-4 ms on two at one row,
11-17 ms against 46-88 ms at 256 rows. So decode-size steps (at most DECODE_TOKENS tokens: skinny,
memory-bound products) run on one thread, and larger ones on `cpu_threads` (--cpu-threads; default:
the usable cores less one, which leaves one to the server process and the rest of the machine: one
thread on 2 cores)."""
from __future__ import annotations

import ctypes
import functools
import glob
import os

DECODE_TOKENS = 16
# (set, get) symbol pairs: the reference build, numpy's scipy-openblas (64-bit ints), older numpy wheels
SYMBOLS = (("openblas_set_num_threads", "openblas_get_num_threads"),
           ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
           ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
           ("openblas_set_num_threads64_", "openblas_get_num_threads64_"))


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_cpu_threads() -> int:
    return max(1, usable_cores() - 1)


class BlasThreads:
    """OpenBLAS's thread count: get() asks it, use(n) sets it where it differs from the last set."""

    def __init__(self, lib: ctypes.CDLL, set_name: str, get_name: str, path: str):
        # a C library's symbols, looked up by name (which BLAS numpy loaded decides the names)
        self._set, self._get, self.path = getattr(lib, set_name), getattr(lib, get_name), path
        self._set.argtypes, self._get.restype = [ctypes.c_int], ctypes.c_int
        self._last: int | None = None

    def get(self) -> int:
        return int(self._get())

    def use(self, threads: int) -> None:
        if threads != self._last:
            self._set(threads)
            self._last = threads


def _loaded_libraries() -> list[str]:
    """Paths of the BLAS libraries this process has loaded (Linux: /proc/self/maps), else numpy's own."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "blas" in line.lower()}
        return sorted(p for p in paths if os.path.isfile(p))
    except OSError:
        import numpy
        root = os.path.dirname(os.path.dirname(numpy.__file__))
        return sorted(glob.glob(os.path.join(root, "numpy*", "*openblas*")) +
                      glob.glob(os.path.join(root, "numpy", ".*libs", "*openblas*")))


@functools.lru_cache(maxsize=1)
def openblas() -> BlasThreads | None:
    """numpy's OpenBLAS, or None where numpy runs another BLAS (Accelerate, MKL: left to their own threads)."""
    import numpy  # noqa: F401  (loads the BLAS numpy links)
    for path in _loaded_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in SYMBOLS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):      # a C library: does it export them?
                return BlasThreads(lib, set_name, get_name, path)
    return None


class CpuThreads:
    """The executor's per-step choice: one BLAS thread for a step of at most DECODE_TOKENS tokens,
    `threads` for a larger one."""

    def __init__(self, threads: int):
        self.threads = threads
        self.blas = openblas()
        self.for_step(0)

    def for_step(self, num_tokens: int) -> None:
        if self.blas is not None:
            self.blas.use(1 if num_tokens <= DECODE_TOKENS else self.threads)

    def describe(self) -> str:
        if self.blas is None:
            return "BLAS threads left to the BLAS library (not OpenBLAS)"
        return (f"OpenBLAS threads: 1 for steps of up to {DECODE_TOKENS} tokens, {self.threads} above "
                f"(--cpu-threads; now {self.blas.get()})")
