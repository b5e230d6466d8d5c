"""Collectives between tensor-parallel ranks: the Communicator protocol, an in-process numpy group (the
CPU executor's ranks run as threads of one process; the tests' simulated ranks) and NCCL on GPUs (one
process per GPU, libnccl from the nvidia-nccl wheel through ctypes, as gpu_gemm.py reaches cuBLAS).

Every collective returns the same bits on every rank: the numpy group sums in rank order on each rank;
NCCL's all-reduce gives all ranks its one result. The NCCL calls are queued on the executor's compute
stream (`bind`), so a decode step's CUDA graph captures them with its kernels (a captured collective is
a collective property: every rank captures, and replays, the graph holding it together).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Protocol

import numpy as np

Array = Any


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: Array) -> Array:
        """The elementwise sum of every rank's x (NCCL: in place, returns x)."""

    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        """[world_size, *x.shape]: every rank's x in rank order (NCCL: into out)."""

    def broadcast(self, x: Array, root: int = 0) -> Array:
        """Rank root's x on every rank (NCCL: in place)."""


class LocalGroup:
    """world_size numpy communicators for threads of one process. A collective puts each rank's array
    in a slot, waits for all of them (a barrier) and reduces the slots in rank order on every rank.
    abort() breaks the collectives in progress (a rank failed: the others raise BrokenBarrierError
    instead of waiting for it); reset() makes the group usable again once no rank is inside one."""

    def __init__(self, world_size: int, timeout: float | None = None):
        self.world_size = world_size
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)

    def communicators(self) -> list["LocalCommunicator"]:
        return [LocalCommunicator(self, r) for r in range(self.world_size)]

    def exchange(self, rank: int, x) -> list:
        """Every rank's x, in rank order (a barrier before the slots are read and one after)."""
        self.slots[rank] = x
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def abort(self) -> None:
        self.barrier.abort()

    def reset(self) -> None:
        self.barrier.reset()


class LocalCommunicator:
    """One rank's view of a LocalGroup."""

    def __init__(self, group: LocalGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        parts = self.group.exchange(self.rank, x)
        total = np.array(parts[0], copy=True)
        for p in parts[1:]:
            total += p
        return total

    def all_gather(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        gathered = np.stack(self.group.exchange(self.rank, x))
        if out is None:
            return gathered
        out[...] = gathered
        return out

    def broadcast(self, x: np.ndarray, root: int = 0) -> np.ndarray:
        return np.array(self.group.exchange(self.rank, x)[root], copy=True)


# ---- NCCL ------------------------------------------------------------------------------------------
NCCL_SUM = 0
# ncclDataType_t by numpy dtype; uint16 holds the engine's bf16 bits (ncclBfloat16, NCCL >= 2.10).
NCCL_TYPES = {np.dtype(np.int32): 2, np.dtype(np.float16): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 9}
UNIQUE_ID_BYTES = 128


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def nccl_library():
    """libnccl.so.2 (the nvidia-nccl wheel's, found by cuda.pathfinder; else the system's), typed."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        lib = ctypes.CDLL(load_nvidia_dynamic_lib("nccl").abs_path)
    except Exception:
        lib = ctypes.CDLL("libnccl.so.2")
    p, i, z = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    signatures = {"ncclGetUniqueId": [ctypes.POINTER(NcclUniqueId)], "ncclGetVersion": [ctypes.POINTER(i)],
                  "ncclCommInitRank": [ctypes.POINTER(p), i, NcclUniqueId, i],
                  "ncclAllReduce": [p, p, z, i, i, p, p], "ncclAllGather": [p, p, z, i, p, p],
                  "ncclBroadcast": [p, p, z, i, i, p, p], "ncclCommDestroy": [p], "ncclCommAbort": [p]}
    for name, args in signatures.items():
        fn = getattr(lib, name)         # a C library's symbol, by name (ctypes)
        fn.argtypes, fn.restype = args, i
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
    return lib


def nccl_unique_id() -> bytes:
    """A fresh communicator id (rank 0 makes it and sends it to the other ranks)."""
    lib = nccl_library()
    uid = NcclUniqueId()
    _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid)


def _check(lib, status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: NCCL error {status} ({lib.ncclGetErrorString(status).decode()})")


def nccl_type(dtype) -> int:
    try:
        return NCCL_TYPES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"no NCCL type for {np.dtype(dtype)}") from None


class NcclCommunicator:
    """One GPU's rank of an NCCL communicator (ncclCommInitRank blocks until every rank has joined).
    Arrays are CuPy arrays (uint16 = bf16); every call is queued on the bound stream (`bind`)."""

    def __init__(self, world_size: int, unique_id: bytes, rank: int):
        self.lib = nccl_library()
        self.rank, self.world_size, self.stream = rank, world_size, 0
        uid = NcclUniqueId.from_buffer_copy(unique_id)
        comm = ctypes.c_void_p()
        _check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        self.comm = comm.value

    def bind(self, stream) -> None:
        """Queue every collective on `stream` (the executor's compute stream)."""
        self.stream = stream.ptr

    def all_reduce_raw(self, ptr: int, count: int, dtype) -> None:
        """In-place sum of `count` values of `dtype` at device address ptr."""
        _check(self.lib, self.lib.ncclAllReduce(ptr, ptr, count, nccl_type(dtype), NCCL_SUM, self.comm, self.stream),
               "ncclAllReduce")

    def all_reduce(self, x):
        self.all_reduce_raw(x.data.ptr, x.size, x.dtype)
        return x

    def all_gather(self, x, out=None):
        """out [world_size, *x.shape] (x may be out[rank]: in place)."""
        if out is None or out.size != x.size * self.world_size or out.dtype != x.dtype:
            raise ValueError("NCCL all_gather needs an out of world_size times x's size and its dtype")
        _check(self.lib, self.lib.ncclAllGather(x.data.ptr, out.data.ptr, x.size, nccl_type(x.dtype), self.comm,
                                                self.stream), "ncclAllGather")
        return out

    def broadcast(self, x, root: int = 0):
        _check(self.lib, self.lib.ncclBroadcast(x.data.ptr, x.data.ptr, x.size, nccl_type(x.dtype), root, self.comm,
                                                self.stream), "ncclBroadcast")
        return x

    def close(self) -> None:
        if self.comm:
            self.lib.ncclCommDestroy(self.comm)
            self.comm = 0
