"""One device allocation, carved by a bump allocator into weights, activations and the paged KV pool.

Sized by `gpu_memory_utilization`: the arena takes that fraction of the device's total memory, less
what other processes (and this one, before the arena) already hold. Nothing else allocates device
memory on the hot path; every buffer an executor uses is a view into this arena.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALIGN = 256


def _check(result):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime error {err!r}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def device_memory_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    from cuda.bindings import runtime

    free, total = _check(runtime.cudaMemGetInfo())
    return int(free), int(total)


def arena_budget(gpu_memory_utilization: float) -> int:
    """Bytes the arena may take: utilization · total − memory already in use."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = device_memory_info()
    budget = int(gpu_memory_utilization * total) - (total - free)
    if budget <= 0:
        raise MemoryError(f"gpu_memory_utilization={gpu_memory_utilization} leaves no memory: "
                          f"{(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB already in use")
    return budget


@dataclass(frozen=True)
class Buffer:
    """One device buffer a GPU part declares: the part sizes itself from the list (`nbytes`) and takes
    exactly that list from the arena (`DeviceArena.take_all`), so its size and its carving agree."""
    name: str
    shape: tuple[int, ...]
    dtype: object

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def buffers_nbytes(buffers: list[Buffer]) -> int:
    """Arena bytes a list of buffers takes, alignment included."""
    return sum(-(-b.nbytes // ALIGN) * ALIGN for b in buffers)


@dataclass
class Carve:
    name: str
    offset: int
    nbytes: int


class DeviceArena:
    """A single cudaMalloc of `nbytes`; `take` hands out aligned CuPy views, never freed individually."""

    def __init__(self, nbytes: int):
        import cupy
        from cuda.bindings import runtime

        self.nbytes = int(nbytes) // ALIGN * ALIGN
        self.ptr = int(_check(runtime.cudaMalloc(self.nbytes)))
        self._memory = cupy.cuda.UnownedMemory(self.ptr, self.nbytes, owner=self)
        self.used = 0
        self.carves: list[Carve] = []

    @property
    def free_bytes(self) -> int:
        return self.nbytes - self.used

    def take(self, name: str, shape: tuple[int, ...], dtype):
        """A CuPy array view of the next free bytes; raises MemoryError naming `name` when full."""
        import cupy

        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > self.free_bytes:
            raise MemoryError(f"device arena: {name} needs {nbytes / 2**20:.1f} MiB, only "
                              f"{self.free_bytes / 2**20:.1f} MiB left of {self.nbytes / 2**30:.2f} GiB "
                              f"(raise gpu_memory_utilization or lower max_num_batched_tokens)")
        offset = self.used
        self.used = offset + (nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.carves.append(Carve(name, offset, nbytes))
        pointer = cupy.cuda.MemoryPointer(self._memory, offset)
        return cupy.ndarray(shape, dtype=dtype, memptr=pointer)

    def take_all(self, prefix: str, buffers: list[Buffer]) -> dict:
        """Every declared buffer, as name -> CuPy array (carved under "prefix.name")."""
        return {b.name: self.take(f"{prefix}.{b.name}", b.shape, b.dtype) for b in buffers}

    def summary(self) -> str:
        by_kind: dict[str, int] = {}
        for c in self.carves:
            kind = c.name.split(".")[0]
            by_kind[kind] = by_kind.get(kind, 0) + c.nbytes
        parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in by_kind.items())
        return f"device arena {self.nbytes / 2**30:.2f} GiB: {parts}"

    def close(self) -> None:
        from cuda.bindings import runtime

        if self.ptr:
            runtime.cudaFree(self.ptr)
            self.ptr = 0
