"""Host KV tier storage beside the GPU KV pool: page-locked host slots and the copies between them
and device blocks (memory/host_tier.py decides which blocks move; this moves the bytes).

Layout. The pool is kv[L, P, blocks*16, H, D] (memory/kv_pool.py: P = 2 planes K and V for GQA, 1 for
MLA's latent): one block's KV is P·L equal pieces ("chunks" of 16*H*D*itemsize bytes), one per
(layer, plane), evenly spaced blocks*chunk bytes apart. The host slots mirror it, host[L, P, slots*16,
H, D], so k consecutive blocks going to k consecutive slots are ONE cudaMemcpy2DAsync: P·L rows of
k*chunk bytes, pitch blocks*chunk on the device, slots*chunk on the host. Each list of pairs is sorted by
destination (stably: a destination written twice in one step keeps its order, the last write wins) and
cut into such runs, and each run is one copy: a prompt's blocks, given slots in the order of their device
blocks when evicted (memory/host_tier.py) and restored into fresh device blocks paired with the slots in
slot order (the scheduler), move as one copy each way instead of one per block (16k tokens of Qwen3-4B: 1,023 copies, ~50 ms of host time
to enqueue and ~21 GB/s, measured on the H200 2026-12-03, bench/results/prefix-ttft-gpu.md).

Why 2D copies and not a gather kernel + one bulk copy: a real model's chunk is 32 KiB (Qwen3-4B/8B:
16 tokens x 8 KV heads x 128 x 2 B), so every DMA row is a burst of 32 KiB or more. Measured on an
H200 (bench/results/host_kv_copy.md): runs of consecutive blocks move at 54 GB/s, the same as one
bulk copy of the bytes (55 GB/s); fully scattered blocks (one 2D copy of 2.25 MiB each) at 40-44
GB/s, with ~5 us of host time per copy to enqueue. A gather kernel + staging buffer could lift only
the scattered case toward the bulk rate (<= ~25%), for an extra device pass and a staging buffer in
the arena; toy models with 1 KiB chunks (1-4 GB/s here) are the case it would really help.
Roofline: the host link, ~55 GB/s each way from pinned memory.

Ordering, with no host synchronization: every copy goes on the executor's compute stream, offloads
then restores, ahead of the step that follows. A block being offloaded was last written by an earlier
step on that stream, and whatever writes it next (a later step, a restore) is queued behind the D2H. A
slot is only written by an offload's D2H and only read by a restore's H2D, both on that stream, so a
slot that HostKVTier hands out again (never one pinned by this step's restores) is overwritten only
after every earlier copy that touched it; the host itself never reads or writes the slots.

cudaMemcpy2D refuses pitches above cudaDevAttrMaxPitch (2^31 - 1 bytes): past it (a plane of the pool
or of the slots over 2 GiB) a run is copied as one 1D copy per plane instead.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from memory.kv_pool import BLOCK_SIZE

MAX_PITCH = (1 << 31) - 1
CUDA_DEV_ATTR_MAX_PITCH = 11

# memcpy2d(dst, dst_pitch, src, src_pitch, width, height, to_host): enqueue one strided copy of
# `height` rows of `width` bytes (addresses and pitches in bytes).
Memcpy2D = Callable[[int, int, int, int, int, int, bool], None]


@dataclass(frozen=True)
class Run:
    """`count` consecutive blocks/slots from src.. to dst.."""
    src: int
    dst: int
    count: int


def _int_pairs(pairs) -> np.ndarray | None:
    """pairs as an [n, 2] integer array, or None where they are not plain int pairs (the loops below
    then name what is wrong)."""
    try:
        a = np.asarray(pairs)
    except (TypeError, ValueError):
        return None
    return a if a.ndim == 2 and a.shape[1] == 2 and a.shape[0] and a.dtype.kind in "iu" else None


def copy_runs(pairs: Sequence[tuple[int, int]], src_limit: int, dst_limit: int, what: str,
              src_name: str, dst_name: str) -> list[Run]:
    """Checked (src, dst) pairs merged, in list order, into runs where both sides step by one (plain int
    pairs in one numpy pass: a 16k-token restore is ~1,000 pairs)."""
    a = _int_pairs(pairs)
    if a is not None and a.min(axis=0).min() >= 0 and a[:, 0].max() < src_limit and a[:, 1].max() < dst_limit:
        src, dst = a[:, 0].astype(np.int64), a[:, 1].astype(np.int64)
        cuts = (np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1).tolist()
        starts, ends = [0] + cuts, cuts + [len(src)]
        return [Run(int(src[i]), int(dst[i]), j - i) for i, j in zip(starts, ends)]
    runs: list[Run] = []
    for pair in pairs:
        try:
            src, dst = (int(x) for x in pair)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: want ({src_name}, {dst_name}) pairs of ints, got {pair!r}") from None
        for name, value, limit in ((src_name, src, src_limit), (dst_name, dst, dst_limit)):
            if not 0 <= value < limit:
                raise ValueError(f"{what} ({src_name} {src} -> {dst_name} {dst}): {name} {value} is "
                                 f"outside 0..{limit - 1}")
        last = runs[-1] if runs else None
        if last and src == last.src + last.count and dst == last.dst + last.count:
            runs[-1] = Run(last.src, last.dst, last.count + 1)
        else:
            runs.append(Run(src, dst, 1))
    return runs


def by_destination(pairs: Sequence[tuple[int, int]]) -> list:
    """The (src, dst) pairs sorted by dst, stably; pairs that are not 2-sequences are left for
    copy_runs to name (sorted last)."""
    a = _int_pairs(pairs)
    if a is not None:
        return a[np.argsort(a[:, 1], kind="stable")]

    def key(pair):
        try:
            return (0, int(pair[1])) if len(pair) == 2 else (1, 0)
        except (TypeError, ValueError, IndexError):
            return (1, 0)
    return sorted(pairs, key=key)


class HostKVCopy:
    """num_slots host blocks for a pool kv[L, P, blocks*16, H, D] at kv_ptr; `host` is the slots'
    array (host[L, P, num_slots*16, H, D], page-locked for asynchronous copies), `memcpy2d` enqueues
    one strided copy."""

    def __init__(self, kv_ptr: int, kv_shape: tuple[int, ...], dtype, host: np.ndarray, memcpy2d: Memcpy2D,
                 max_pitch: int = MAX_PITCH):
        if len(kv_shape) != 5 or kv_shape[2] % BLOCK_SIZE:
            raise ValueError(f"KV pool shape {tuple(kv_shape)}: want (layers, planes, blocks*{BLOCK_SIZE}, heads, dim)")
        L, P, rows, Hkv, D = kv_shape
        self.dtype = np.dtype(dtype)
        self.num_blocks = rows // BLOCK_SIZE
        self.num_slots = host.shape[2] // BLOCK_SIZE if host.ndim == 5 else 0
        want = (L, P, self.num_slots * BLOCK_SIZE, Hkv, D)
        if self.num_slots < 1 or host.shape != want or host.dtype != self.dtype or not host.flags.c_contiguous:
            raise ValueError(f"host KV slots {host.shape} {host.dtype}: want a contiguous {self.dtype} array "
                             f"(layers, planes, slots*{BLOCK_SIZE}, heads, dim) like {want}")
        self.kv_ptr, self.host, self.memcpy2d = int(kv_ptr), host, memcpy2d
        self.planes, self.layers = P * L, L
        self.chunk = BLOCK_SIZE * Hkv * D * self.dtype.itemsize
        self.max_pitch = int(max_pitch)

    @property
    def block_bytes(self) -> int:
        return self.planes * self.chunk

    def with_memcpy(self, memcpy2d: Memcpy2D) -> "HostKVCopy":
        """The same slots and pool, copies enqueued through another memcpy2d (another stream)."""
        other = copy.copy(self)
        other.memcpy2d = memcpy2d
        return other

    def copy_blocks(self, offloads: Sequence[tuple[int, int]], restores: Sequence[tuple[int, int]]) -> int:
        """Enqueue offloads (device block -> host slot), then restores (host slot -> device block);
        both lists are checked before anything is enqueued. Returns the number of copies enqueued."""
        down = copy_runs(by_destination(offloads), self.num_blocks, self.num_slots, "offload", "device block",
                         "host slot")
        up = copy_runs(by_destination(restores), self.num_slots, self.num_blocks, "restore", "host slot",
                       "device block")
        return sum(self._copy(r, to_host=True) for r in down) + sum(self._copy(r, to_host=False) for r in up)

    def restore_layers(self, restores: Sequence[tuple[int, int]], layer_done: Callable[[int], None]) -> int:
        """Enqueue restores (host slot -> device block) one layer at a time, layer_done(l) after layer l's
        copies (an event there lets a forward start layer l while later layers still copy)."""
        up = copy_runs(by_destination(restores), self.num_slots, self.num_blocks, "restore", "host slot",
                       "device block")
        per_layer = self.planes // self.layers
        n = 0
        for layer in range(self.layers):
            rows = range(layer * per_layer, (layer + 1) * per_layer)
            n += sum(self._copy(r, to_host=False, rows=rows) for r in up)
            layer_done(layer)
        return n

    def _copy(self, run: Run, to_host: bool, rows: range | None = None) -> int:
        """One run over the plane rows `rows` (default: every layer's planes)."""
        c = self.chunk
        rows = rows if rows is not None else range(self.planes)
        device, host = (self.kv_ptr, self.num_blocks * c), (self.host.ctypes.data, self.num_slots * c)
        (src, src_pitch), (dst, dst_pitch) = (device, host) if to_host else (host, device)
        src = src + run.src * c + rows.start * src_pitch
        dst, width = dst + run.dst * c + rows.start * dst_pitch, run.count * c
        if max(src_pitch, dst_pitch) <= self.max_pitch:
            self.memcpy2d(dst, dst_pitch, src, src_pitch, width, len(rows), to_host)
            return 1
        for p in range(len(rows)):
            self.memcpy2d(dst + p * dst_pitch, width, src + p * src_pitch, width, width, 1, to_host)
        return len(rows)


def gpu_host_kv_copy(kv_cache, num_slots: int, stream) -> HostKVCopy:
    """Pinned host slots for a CuPy KV pool, with copies enqueued on `stream` (cudaMemcpy2DAsync)."""
    import cupy

    from memory.streams import pinned_array

    rt = cupy.cuda.runtime
    if num_slots < 1:
        raise ValueError(f"host KV tier needs at least 1 slot, got {num_slots}")
    L, P, _, Hkv, D = kv_cache.shape
    shape = (L, P, int(num_slots) * BLOCK_SIZE, Hkv, D)
    nbytes = int(np.prod(shape, dtype=np.int64)) * kv_cache.dtype.itemsize
    try:
        host = pinned_array(shape, kv_cache.dtype)
    except (cupy.cuda.memory.OutOfMemoryError, rt.CUDARuntimeError) as e:
        raise MemoryError(f"host_kv_blocks={num_slots}: {nbytes / 2**30:.2f} GiB of pinned host memory "
                          f"could not be allocated ({e}); lower host_kv_blocks") from None
    max_pitch = rt.deviceGetAttribute(CUDA_DEV_ATTR_MAX_PITCH, kv_cache.device.id)
    return HostKVCopy(kv_cache.data.ptr, kv_cache.shape, kv_cache.dtype, host, gpu_memcpy2d(stream), max_pitch)


def gpu_memcpy2d(stream) -> Memcpy2D:
    """cudaMemcpy2DAsync on `stream`."""
    import cupy

    rt = cupy.cuda.runtime
    kinds = {True: rt.memcpyDeviceToHost, False: rt.memcpyHostToDevice}

    def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, to_host: bool) -> None:
        rt.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kinds[to_host], stream.ptr)
    return memcpy2d
