"""Split-K reductions, CuTe DSL: the separate kernel ``out[m, n] = bf16(sum_s partial[m, n, s] (+ res[m, n]))``
and ``reduce_splits``, the same done inside the "sk" GEMM variants.

``partial`` is the float32 ``(M, N, S)`` workspace written by the split-K GEMM (``S`` slices of
``M·N``, contiguous); ``out`` is a row-major bf16 ``[M, N]`` with a free leading dimension. One
thread per output element, consecutive threads on consecutive ``n`` (coalesced), the ``S`` loads in
flight together. Memory-bound: ``4·M·N·S + 2·M·N`` bytes at ~4.8 TB/s; for the decode shapes it
serves (M ≤ 64) that is a few percent of the weight read of the GEMM before it.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

THREADS = 256


@cute.kernel
def _reduce_kernel(partial: cute.Tensor, out: cute.Tensor, res: cute.Tensor, add_res: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    n = bidx * THREADS + tidx
    m = bidy
    if n < cute.size(out, mode=[1]):
        total = cutlass.Float32(0.0)
        for s in cutlass.range(cute.size(partial, mode=[2]), unroll=4):
            total += partial[m, n, s]
        if cutlass.const_expr(add_res):
            total += res[m, n].to(cutlass.Float32)
        out[m, n] = total.to(out.element_type)


def _launch(partial, out, res, add_res, stream):
    n_blocks = (cute.size(out, mode=[1]) + THREADS - 1) // THREADS
    _reduce_kernel(partial, out, res, add_res).launch(
        grid=(n_blocks, cute.size(out, mode=[0]), 1), block=(THREADS, 1, 1), stream=stream
    )


@cute.jit
def splitk_reduce(partial: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
    """Launch one CTA row per output row, ``ceil(N / 256)`` CTAs across."""
    _launch(partial, out, out, False, stream)


@cute.jit
def splitk_reduce_residual(partial: cute.Tensor, out: cute.Tensor, res: cute.Tensor, stream: cuda.CUstream):
    """The same, adding ``res[m, n]`` (which may be ``out`` itself) before the rounding."""
    _launch(partial, out, res, True, stream)


MAX_SPLITS = 16  # configs.MAX_SPLITS: the reduction reads this many slots, clamped and masked


@cute.jit
def reduce_splits(acc: cute.Tensor, thr_c, ws: cute.Tensor, tickets: cute.Tensor, ticket: cute.Tensor,
                  d: cute.Tensor, r: cute.Tensor, pid_m: cutlass.Int32, pid_n: cutlass.Int32,
                  tile: cutlass.Int32, split: cutlass.Int32, splits: cutlass.Int32, tidx: cutlass.Int32,
                  threads: cutlass.Constexpr, tile_mn: cutlass.Constexpr, add_r: cutlass.Constexpr):
    """In-kernel split-K reduction (the ``out='sk'`` GEMM variants), run by every split's CTA after
    its mainloop: ``D = bf16(sum_s partial_s (+ R))`` for the tile, written by its last split.

    Each CTA stores its fp32 accumulators to its own ``tile_m x tile_n`` row-major slot of ``ws``
    (rows below M only: at decode sizes most of a 64-row tile is padding), then takes a ticket (an
    acq_rel atomic on the tile's counter). The CTA that draws ``splits - 1`` sums the slots in split
    order (a fixed order: deterministic), four columns per thread at a time with all ``MAX_SPLITS``
    loads independent (indices clamped to the last split, extra terms masked), adds R, writes D with
    plain stores and resets the counter. Traffic: ``4·rows·tile_n·2S`` bytes through L2 per tile,
    in place of the separate reduction kernel and its launch.
    """
    tile_m, tile_n = tile_mn
    rows = cutlass.min(cute.size(d, mode=[0]) - pid_m * tile_m, tile_m)
    slot_elems = tile_m * tile_n
    flat = cute.make_tensor(ws.iterator, cute.make_layout(cute.size(ws)))
    coords = thr_c.partition_C(cute.make_identity_tensor(tile_mn))
    mine = (tile * splits + split) * slot_elems
    for v in cutlass.range_constexpr(cute.size(acc)):
        if coords[v][0] < rows:
            flat[mine + coords[v][0] * tile_n + coords[v][1]] = acc[v]
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()
    if tidx == 0:
        ticket[0] = cute.arch.atomic_add(tickets.iterator + tile, cutlass.Int32(1), sem="acq_rel", scope="gpu")
    cute.arch.sync_threads()
    if ticket[0] == splits - 1:
        cute.arch.fence_acq_rel_gpu()
        first = tile * splits * slot_elems
        quads = tile_n // 4
        total = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
        for i in cutlass.range(tidx, rows * quads, threads, unroll=1):
            row = i // quads
            col = (i % quads) * 4
            m, n = pid_m * tile_m + row, pid_n * tile_n + col
            if n < cute.size(d, mode=[1]):  # N % 8 == 0: a quad is all in or all out
                for j in cutlass.range_constexpr(4):
                    total[j] = cutlass.Float32(0.0)
                for s in cutlass.range_constexpr(MAX_SPLITS):
                    src = first + cutlass.min(s, splits - 1) * slot_elems + row * tile_n + col
                    for j in cutlass.range_constexpr(4):
                        x = flat[src + j]
                        total[j] = total[j] + cutlass.Float32(cutlass.select_(s < splits, x, cutlass.Float32(0.0)))
                for j in cutlass.range_constexpr(4):
                    if cutlass.const_expr(add_r):
                        total[j] = total[j] + r[m, n + j, 0].to(cutlass.Float32)
                    d[m, n + j, 0] = total[j].to(d.element_type)
        if tidx == 0:
            tickets[tile] = 0
