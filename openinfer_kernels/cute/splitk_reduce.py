"""Split-K reduction: ``out[m, n] = bf16(sum_s partial[m, n, s] (+ res[m, n]))``, CuTe DSL.

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
    # Let the next kernel launch at once (it waits for this grid itself), so that a weight stream
    # after the reduction can load its first tiles while the GEMM before it finishes; then wait
    # for that GEMM (a programmatic dependent launch: the partials come from it).
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()
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
        grid=(n_blocks, cute.size(out, mode=[0]), 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True,
    )


@cute.jit
def splitk_reduce(partial: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
    """Launch one CTA row per output row, ``ceil(N / 256)`` CTAs across."""
    _launch(partial, out, out, False, stream)


@cute.jit
def splitk_reduce_residual(partial: cute.Tensor, out: cute.Tensor, res: cute.Tensor, stream: cuda.CUstream):
    """The same, adding ``res[m, n]`` (which may be ``out`` itself) before the rounding."""
    _launch(partial, out, res, True, stream)
