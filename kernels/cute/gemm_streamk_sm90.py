"""Stream-K Hopper bf16 GEMM, ``D[m, n] = sum_k A[m, k] * B[n, k]`` (fp32 accumulate), CuTe DSL.

Why: with 128-row tiles some shapes leave SMs idle however the N tile is chosen (Qwen3-4B o/down,
N = 2560, at M = 512: 40 tiles of 128x256 or 80 of 128x128 on 132 SMs). Here one persistent CTA
per SM (``G`` = the size of ``flags``) takes an even, contiguous share ``[g·U/G, (g+1)·U/G)`` of the
``U = tiles · k_tiles`` (tile, 64-wide k-tile) steps, tiles ordered M-fastest. A CTA's share splits
into segments, one per tile it touches:
- a whole tile: the accumulator goes out as bf16 through the usual smem + TMA-store epilogue;
- the tile's tail (the share starts mid-tile; only a share's first segment can): the fp32
  accumulator goes to the CTA's own slot of ``workspace`` in register order (coalesced, no smem),
  then a release store sets ``flags[g] = 1``;
- the tile's head (the share ends mid-tile): the CTA waits (acquire loads) for the flag of each
  later CTA that holds part of this tile, adds their slots into its registers, clears their flags
  (so the next launch starts from zeros: graph replays need no memset) and stores the tile.
The head owner is the CTA that reaches the tile last in its share, so the wait is short. Waiting
only on higher-numbered CTAs, with ``G`` no larger than the SMs that can hold one CTA each, cannot
deadlock on one stream; two stream-K GEMMs must not run concurrently on one workspace.

The mainloop runs the TMA ring across segment boundaries, so the next tile's first stages load
while the current one is stored. Roofline: as ``gemm_sm90`` (~790 TFLOP/s dense bf16), the
partial traffic (``4·128·256`` bytes per split tile, through L2) is a few percent at M = 512.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from .configs import GemmVariant
from .gemm_sm90 import GemmSm90


class GemmStreamKSm90(GemmSm90):
    """Builds the stream-K jit entry ``(a, b, c, workspace, flags, stream)`` for one variant."""

    def __init__(self, tile: GemmVariant):
        assert tile.streamk and tile.cluster_m == tile.cluster_n == 1 and tile.out == "bf16"
        super().__init__(tile)
        self.epi_in_ring = False  # the ring keeps loading the next tile while this one is stored
        self.epi_stages = 2

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, workspace: cute.Tensor,
                 flags: cute.Tensor, stream: cuda.CUstream):
        tma_a, ta, tma_b, tb, tma_c, tc = self._prepare(a, b, c)

        @cute.struct
        class Smem:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.sa_layout)], self.buffer_align]
            sb: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.sb_layout)], self.buffer_align]
            sc: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.sc_layout)], self.buffer_align]

        self.smem_struct = Smem
        self.sk_kernel(tma_a, ta, tma_b, tb, tma_c, tc, workspace, flags, self.tiled_mma,
                       self.sa_layout, self.sb_layout, self.sc_layout).launch(
            grid=(cute.size(flags), 1, 1), block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream,
        )

    @cute.kernel
    def sk_kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                  tma_c: cute.CopyAtom, mC: cute.Tensor, workspace: cute.Tensor, flags: cute.Tensor,
                  tiled_mma: cute.TiledMma, sa_layout: cute.ComposedLayout,
                  sb_layout: cute.ComposedLayout, sc_layout: cute.ComposedLayout):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
        stage_bytes = cute.size_in_bytes(self.a_dtype, cute.slice_(sa_layout, (None, None, 0))) + \
            cute.size_in_bytes(self.a_dtype, cute.slice_(sb_layout, (None, None, 0)))
        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sA = storage.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sB = storage.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        sC = storage.sc.get_tensor(sc_layout.outer, swizzle=sc_layout.inner)

        gA = cute.local_tile(mA, self.tile_mnk, (None, None, None, 0), proj=(1, None, 1))  # (bM, bK, tm, tk)
        gB = cute.local_tile(mB, self.tile_mnk, (None, None, None, 0), proj=(None, 1, 1))  # (bN, bK, tn, tk)
        gC = cute.local_tile(mC, self.tile_mnk, (None, None, None, 0), proj=(1, 1, None))  # (bM, bN, tm, tn)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.num_mma_wg, stride=128)(wg))
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC[(None, None, 0, 0)]).shape, self.acc_dtype)

        k_tiles = cute.size(gA, mode=[3])
        m_tiles = cute.size(gC, mode=[2])
        n_tiles = cute.size(gC, mode=[3])
        ctas = cute.size(flags)
        sched = self._schedule(cta, ctas, m_tiles * n_tiles, k_tiles)
        n_units = sched[1] - sched[0] + sched[3] - sched[2]

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if warp == 0:  # fill the ring
            for _ in cutlass.range(cutlass.min(self.stages, n_units), unroll=1):
                self._load_unit(ring, produce, sched, ctas, k_tiles, m_tiles, n_tiles,
                                tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
                produce.advance()

        k_blocks = cute.size(frag_a, mode=[2])
        for i in cutlass.range(n_units, unroll=1):
            u, lo, hi = self._unit(sched, i)
            tile_base = (u // k_tiles) * k_tiles
            seg_begin = cutlass.max(tile_base, lo)
            seg_end = cutlass.min(tile_base + k_tiles, hi)
            ring.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, u != seg_begin)
            for kb in cutlass.range(k_blocks, unroll_full=True):
                blk = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, frag_a[blk], frag_b[blk], acc)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            read.advance()
            if i > 0:  # keep one wgmma batch in flight; free (and refill) the stage of the one before
                cute.nvgpu.warpgroup.wait_group(1)
                ring.consumer_release(release)
                release.advance()
                if warp == 0 and produce.count < n_units:
                    self._load_unit(ring, produce, sched, ctas, k_tiles, m_tiles, n_tiles,
                                    tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
                    produce.advance()
            if u + 1 == seg_end:
                cute.nvgpu.warpgroup.wait_group(0)
                if seg_begin != tile_base:
                    self._store_partial(acc, workspace, flags, cta, tidx)
                else:
                    if seg_end != tile_base + k_tiles:
                        self._add_partials(acc, workspace, flags, cta, tidx, tile_base + k_tiles - sched[6],
                                           ctas, sched[4])
                    pm, pn = self._raster(self._real_tile(u // k_tiles, sched, ctas), m_tiles, n_tiles)
                    self._epilogue(tidx, warp, tiled_mma, acc, sC, gC[(None, None, pm, pn)], tma_c)

    @cute.jit
    def _schedule(self, cta, ctas, tiles, k_tiles):
        """This CTA's work in virtual unit space:
        (dp_lo, dp_hi, sk_lo, sk_hi, sk_units, dp_rounds, dp_units).

        With ``r = tiles // ctas`` full rounds and a remainder, the first ``r - 1`` rounds go whole
        tile by whole tile (CTA g: virtual tiles ``g·(r-1) …``, real tiles ``g, g + ctas, …``), and
        the last ``ctas + remainder`` tiles are shared out evenly, unit by unit (stream-K); with no
        remainder every round is whole tiles, with fewer tiles than CTAs all of it is stream-K."""
        rounds = tiles // ctas
        dp_rounds = rounds
        if tiles != rounds * ctas:
            dp_rounds = cutlass.max(rounds - 1, 0)
        dp_units = ctas * dp_rounds * k_tiles
        sk_units = tiles * k_tiles - dp_units
        dp_lo = cta * dp_rounds * k_tiles
        sk_lo = dp_units + (cta * sk_units) // ctas  # the launcher keeps ctas <= units: none is empty
        sk_hi = dp_units + ((cta + 1) * sk_units) // ctas
        return dp_lo, dp_lo + dp_rounds * k_tiles, sk_lo, sk_hi, sk_units, dp_rounds, dp_units

    @cute.jit
    def _unit(self, sched, i):
        """The CTA's i-th step: (virtual unit, start and end of the range it lies in)."""
        dp_len = sched[1] - sched[0]
        u = sched[2] + i - dp_len
        lo = sched[2]
        hi = sched[3]
        if i < dp_len:
            u = sched[0] + i
            lo = sched[0]
            hi = sched[1]
        return u, lo, hi

    @cute.jit
    def _real_tile(self, virtual, sched, ctas):
        """Virtual tile → rasterised tile index: the whole-tile rounds interleave CTAs (round r runs
        tiles r·ctas … r·ctas + ctas - 1 together); stream-K tiles keep their order after them."""
        dp_rounds = sched[5]
        real = virtual
        if virtual < ctas * dp_rounds:
            real = (virtual % dp_rounds) * ctas + virtual // dp_rounds
        return real

    @cute.jit
    def _load_unit(self, ring, state, sched, ctas, k_tiles, m_tiles, n_tiles, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB):
        u, _, _ = self._unit(sched, state.count)
        tile = u // k_tiles
        k = u - tile * k_tiles
        pm, pn = self._raster(self._real_tile(tile, sched, ctas), m_tiles, n_tiles)
        ring.producer_acquire(state)
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_a, tAgA[(None, pm, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, tBgB[(None, pn, k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
        ring.producer_commit(state)

    @cute.jit
    def _store_partial(self, acc, workspace, flags, cta, tidx):
        """This CTA's fp32 accumulator to its workspace slot, then flag it (release, GPU scope)."""
        n_acc = cute.size(acc)
        base = cta * (n_acc * self.threads) + tidx
        for v in cutlass.range_constexpr(n_acc):
            workspace[base + v * self.threads] = acc[v]
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.store(flags.iterator + cta, cutlass.Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _add_partials(self, acc, workspace, flags, cta, tidx, tile_end, ctas, sk_units):
        """Add the slots of the later CTAs sharing this tile, up to the one holding its last step
        (``tile_end``: the tile's end, counted from the start of the stream-K units)."""
        n_acc = cute.size(acc)
        last = (tile_end * ctas - 1) // sk_units
        for peer in cutlass.range(cta + 1, last + 1, unroll=1):
            seen = cute.arch.load(flags.iterator + peer, cutlass.Int32, sem="acquire", scope="gpu")
            while seen == 0:
                seen = cute.arch.load(flags.iterator + peer, cutlass.Int32, sem="acquire", scope="gpu")
            cute.arch.sync_threads()  # every thread has seen the flag before it is cleared
            if tidx == 0:
                cute.arch.store(flags.iterator + peer, cutlass.Int32(0), sem="relaxed", scope="gpu")
            base = peer * (n_acc * self.threads) + tidx
            for v in cutlass.range_constexpr(n_acc):
                acc[v] = acc[v] + workspace[base + v * self.threads]
