"""Hopper bf16 GEMM with A in registers, ``D[m, n] = sum_k A[m, k] * B[n, k]`` (fp32 acc), CuTe DSL.

Why: in ``gemm_sm90`` a 128 x TN tile on two consumer warpgroups moves ``(128 + TN)·128`` bytes per
64-deep k-tile into shared memory (TMA) and ``2·(64 + TN)·128`` bytes out of it (wgmma operands),
``256 + 3·TN`` cycles at 128 B/clk against ``4·TN`` cycles of tensor work, so tiles narrower than
256 are bound by shared memory (measured 0.64 / 0.85 / 0.88 / 0.95 of 128x256's rate per element at
TN = 80 / 128 / 160 / 192, as the ratio predicts). Here only B (the weights) goes through shared
memory: each thread loads its own wgmma A fragment (``OperandSource.RMEM``) straight from global
memory, ``A_DEPTH - 1`` k-tiles ahead in a ring of register fragments, so the traffic is
``3·TN`` cycles and every width is tensor-bound on this model.

Structure otherwise as ``gemm_sm90``: B k-tiles through a TMA ring (optionally multicast over a
cluster along M), warp 0 doubles as producer, wgmma into fp32 registers on two warpgroups of 64 rows
each, the same smem + TMA-store epilogue (its staging buffer is its own: there is no A ring).
Rows past M and columns past K of A load as zeros (predicated), full tiles load unpredicated.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu.warpgroup import OperandSource

from .configs import GemmVariant
from .gemm_sm90 import SM90_SMEM_BYTES, GemmSm90

A_DEPTH = 3      # register fragments of A in flight: loads run A_DEPTH - 1 k-tiles ahead of the wgmma
MAX_STAGES = 8   # B stages (narrow B tiles would otherwise take 20 and leave little L1 for A's loads)


class GemmRsSm90(GemmSm90):
    """Builds the jit entry ``(a, b, c, stream)`` of an A-in-registers variant (``a_regs=True``)."""

    def __init__(self, tile: GemmVariant):
        assert tile.a_regs and tile.tile_m == 128 and tile.cluster_n == 1 and not tile.grouped
        super().__init__(tile)
        self.atom_layout_mnk = (2, 1, 1)  # two warpgroups, 64 rows each, whatever the width
        self.num_mma_wg = 2
        self.threads = 256
        self.epi_stages = 4

    def _setup_rs(self, a_dtype, c_dtype, a_layout, b_layout, c_layout):
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            a_dtype, a_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile.tile_n), a_source=OperandSource.RMEM,
        )
        k_inst = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        self.tile_mnk = (self.tile.tile_m, self.tile.tile_n, 4 * k_inst)
        self.cta_layout_mnk = cute.make_layout((*self.cluster_mn, 1))
        self.mcast_a, self.mcast_b = 1, self.cluster_mn[0]
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_mnk, c_dtype, is_cooperative=True,
            epi_tile_override=None if self.tile.tile_n % 32 == 0 else (self.tile.tile_m, 16),
        )
        self.sc_layout = sm90_utils.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile, self.epi_stages)
        epi_bytes = cute.cosize(self.sc_layout) * c_dtype.width // 8
        stage_bytes = self.tile_mnk[1] * self.tile_mnk[2] * a_dtype.width // 8
        self.stages = min(MAX_STAGES, (SM90_SMEM_BYTES - 2048 - epi_bytes) // stage_bytes)
        self.sb_layout = sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, a_dtype, self.stages)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: cuda.CUstream):
        self.a_dtype = a.element_type
        self.c_dtype = c.element_type
        self.c_layout = utils.LayoutEnum.from_tensor(c)
        self._setup_rs(self.a_dtype, self.c_dtype, utils.LayoutEnum.from_tensor(a),
                       utils.LayoutEnum.from_tensor(b), self.c_layout)
        load_b = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if self.mcast_b == 1
                  else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        tma_b, tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_b, b, cute.slice_(self.sb_layout, (None, None, 0)),
            (self.tile_mnk[1], self.tile_mnk[2]), num_multicast=self.mcast_b,
        )
        tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c,
            cute.slice_(self.sc_layout, (None, None, 0)), self.epi_tile,
        )
        tiles = cute.zipped_divide(c, tiler=(self.tile_mnk[0], self.tile_mnk[1]))
        cluster_mnl = (*self.cluster_mn, 1)
        clusters = cute.ceil_div(cute.get(tiles.layout, mode=[1]).shape, cluster_mnl)
        grid = tuple(x * y for x, y in zip(clusters, cluster_mnl))

        @cute.struct
        class Smem:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sb: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.sb_layout)], self.buffer_align]
            sc: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.sc_layout)], self.buffer_align]

        self.smem_struct = Smem
        self.rs_kernel(a, tma_b, tb, tma_c, tc, self.tiled_mma, self.cta_layout_mnk,
                       self.sb_layout, self.sc_layout).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=cluster_mnl, stream=stream,
        )

    @cute.kernel
    def rs_kernel(self, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, tma_c: cute.CopyAtom,
                  mC: cute.Tensor, tiled_mma: cute.TiledMma, cta_layout_mnk: cute.Layout,
                  sb_layout: cute.ComposedLayout, sc_layout: cute.ComposedLayout):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
        pid_m, pid_n = self._tile_coord()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(rank)
        mask_b = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        mask_b = mask_b if self.mcast_b > 1 else 0

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mcast_b * (self.threads // 32)),
            tx_count=cute.size_in_bytes(self.a_dtype, cute.slice_(sb_layout, (None, None, 0))),
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)), defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)
        sB = storage.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        sC = storage.sc.get_tensor(sc_layout.outer, swizzle=sc_layout.inner)

        coord = (pid_m, pid_n, None, 0)
        gA = cute.local_tile(mA, self.tile_mnk, coord, proj=(1, None, 1))  # (bM, bK, k_tiles)
        cA = cute.local_tile(cute.make_identity_tensor(mA.shape), self.tile_mnk, coord, proj=(1, None, 1))
        gB = cute.local_tile(mB, self.tile_mnk, coord, proj=(None, 1, 1))  # (bN, bK, k_tiles)
        gC = cute.local_tile(mC, self.tile_mnk, (pid_m, pid_n, None, 0), proj=(1, 1, None))  # (bM, bN)
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.num_mma_wg, stride=128)(wg))
        tCgA = thr_mma.partition_A(gA)
        tCcA = thr_mma.partition_A(cA)
        frags = [tiled_mma.make_fragment_A(tCgA[(None, None, None, 0)]) for _ in range(A_DEPTH)]
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
        )
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape, self.acc_dtype)

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
        k_tiles = cute.size(gA, mode=[2])
        m_full = (pid_m + 1) * self.tile_mnk[0] <= cute.size(mA, mode=[0])
        k_full = cute.size(mA, mode=[1]) // self.tile_mnk[2]  # k-tiles with no K tail
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if warp == 0:  # fill the ring
            for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                self._load_b(ring, produce, tma_b, tBgB, tBsB, mask_b)
                produce.advance()
        for j in cutlass.range_constexpr(A_DEPTH - 1):  # A fragments of the first k-tiles
            if j < k_tiles:
                self._load_a(frags[j], tCgA, tCcA, j, m_full, k_full, mA)

        k_blocks = cute.size(frag_b, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        for k0 in cutlass.range(0, k_tiles, A_DEPTH, unroll=1):
            for j in cutlass.range_constexpr(A_DEPTH):
                k = k0 + j
                if k < k_tiles:
                    ring.consumer_wait(read)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range(k_blocks, unroll_full=True):
                        cute.gemm(tiled_mma, acc, frags[j][(None, None, kb)], frag_b[(None, None, kb, read.index)], acc)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.commit_group()
                    read.advance()
                    if k > 0:  # the batch before is done: free its B stage and its A fragment
                        cute.nvgpu.warpgroup.wait_group(1)
                        ring.consumer_release(release)
                        release.advance()
                        if warp == 0 and produce.count < k_tiles:
                            self._load_b(ring, produce, tma_b, tBgB, tBsB, mask_b)
                            produce.advance()
                    if k + A_DEPTH - 1 < k_tiles:  # into the fragment of k - 1 (free now)
                        self._load_a(frags[(j + A_DEPTH - 1) % A_DEPTH], tCgA, tCcA, k + A_DEPTH - 1,
                                     m_full, k_full, mA)
        cute.nvgpu.warpgroup.wait_group(0)

        if cute.size(self.cluster_mn) > 1:  # peers may still multicast into our smem
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        self._epilogue(tidx, warp, tiled_mma, acc, sC, gC, tma_c)

    @cute.jit
    def _load_b(self, ring, state, tma_b, tBgB, tBsB, mask_b):
        ring.producer_acquire(state)
        cute.copy(tma_b, tBgB[(None, state.count)], tBsB[(None, state.index)],
                  tma_bar_ptr=ring.producer_get_barrier(state), mcast_mask=mask_b)
        ring.producer_commit(state)

    @cute.jit
    def _load_a(self, frag, tCgA, tCcA, k, m_full, k_full, mA):
        """This thread's A fragment of k-tile ``k`` into registers; zeros past M and past K."""
        src = tCgA[(None, None, None, k)]
        if m_full and k < k_full:
            cute.autovec_copy(src, frag)
        else:
            crd = tCcA[(None, None, None, k)]
            for i in cutlass.range_constexpr(cute.size(frag)):
                frag[i] = frag.element_type(0)
                if crd[i][0] < cute.size(mA, mode=[0]):
                    if crd[i][1] < cute.size(mA, mode=[1]):
                        frag[i] = src[i]
