"""Hopper bf16 GEMM, ``D[m, n, l] = sum_k A[m, k, l] * B[n, k, l]`` (fp32 accumulate), CuTe DSL.

A is ``[M, K]`` row-major activations, B is ``[N, K]`` row-major weights (the Hugging Face layout),
D is ``[M, N, S]``: with ``S = 1`` this is the plain ``D = A·Bᵀ``; with ``S > 1`` (split-K) the CTA
with grid z-index ``s`` sums only its share ``s`` of the 64-wide k-tiles (``ceil(k_tiles / S)``
each) into the float32 slice ``D[:, :, s]``, and ``splitk_reduce`` adds the slices afterwards. A and
B keep plain descriptors (a third mode of extent 1), so split-K needs nothing of K but ``K % 8 == 0``.

Structure: TMA loads of A and B tiles into a multi-stage shared-memory ring (mbarrier pipeline,
optional cluster multicast), wgmma from shared memory into fp32 registers (one to three consumer
warpgroups), epilogue through shared memory (stmatrix for 16-bit output) and TMA stores, which clip
the M/N tails (``gemm_sm90_epilogue``). Warp-specialised variants (``ws``) add a producer
warpgroup whose warp 0 issues every load; in the others warp 0 of the MMA warpgroups refills the
ring between its wgmmas, which stalls its warpgroup whenever a multicast peer is behind.
Grouped variants (MoE) take B as ``(N, K, E)`` expert weights and an int32 map from each M-tile to
its expert: tokens are grouped by expert and each group padded to whole M-tiles
(``moe.group_by_expert``), so one launch covers every expert.
CTAs are rasterised in groups of 8 clusters along M so that concurrently running CTAs share B
(weight) tiles in L2.

Variants on top: residual twins (``D = A·Bᵀ + R``: R's tile is TMA-loaded into shared memory at
tile start and read back with ldmatrix in accumulator order, added in fp32 before the rounding);
K-split pairs (``k_split=2``: a cluster of two CTAs per tile, each on half of K, the second adding
its fp32 sums into the first's idle B ring over distributed shared memory); SiLU·up twins
(``silu=True``: D is ``[M, N/2]``, ``SiLU(gate)·up`` of a gate_up product whose B rows alternate 8 gate
and 8 up rows, computed from the accumulators and stored through a half-width MMA's layout); and
``a_rows`` twins for M <= a_rows (the TMA loads only that many rows of A's 64-row tile: the MMA's
other rows read stale shared memory into output rows that are never stored). Every GEMM is a
programmatic dependent launch: it waits (``griddepcontrol.wait``) before touching A, R or D, may
load its first weight tiles before that (``b_early``), and lets the next kernel launch early.

FP8 twins (``fp8=True``): A and B e4m3, block-scaled (``gemm_sm90_fp8``: per-128 k-tile scales applied in
the mainloop), bf16 D; warp-specialised, one or two consumer warpgroups, clusters allowed, no other variant on top.

Roofline on the H200: ``2·M·N·K`` flops at ~790 TFLOP/s (measured dense bf16) against
``2·(M·K + N·K + M·N)`` bytes at ~4.8 TB/s. Intensity crosses ~165 flop/byte near M ≈ 200 for the
Qwen3 projection shapes: below, the weight read bounds the time (small-M decode), above, the
tensor cores do.
"""
from __future__ import annotations

import math
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

from .configs import H200_SMS, GemmVariant
from .gemm_sm90_epilogue import EpilogueSm90
from .gemm_sm90_fp8 import BlockScaledMainloopSm90

SM90_SMEM_BYTES = 232448  # usable dynamic shared memory per CTA on sm_90 (227 KiB)
RASTER_GROUP = 8


class GemmSm90(EpilogueSm90, BlockScaledMainloopSm90):
    """Builds the jit entry point for one GemmVariant; call it through ``cute.compile``."""

    def __init__(self, tile: GemmVariant):
        assert tile.tile_m in (64, 128, 192) and tile.tile_n in (48, 64, 80, 96, 128, 160, 192, 256, 320)
        assert not (tile.ws and tile.tile_n > 256), "a producer warpgroup leaves too few registers for 320 columns"
        assert tile.cluster_m * tile.cluster_n <= 4
        assert not (tile.grouped and tile.cluster_m > 1), "a cluster along M would mix experts"
        assert tile.k_split in (1, 2) and (tile.k_split == 1 or tile.cluster_m * tile.cluster_n == 1)
        assert tile.a_rows == 0 or (tile.tile_m == 64 and tile.a_rows % 8 == 0 and tile.a_rows < 64
                                    and tile.k_split == 1 and not tile.grouped)
        assert not tile.silu or (tile.out == "bf16" and tile.k_split == 1 and not (tile.residual or tile.grouped)
                                 and tile.tile_n % 32 == 0 and tile.tile_n <= 256)
        assert not tile.fp8 or (tile.ws and tile.out == "bf16" and tile.tile_m in (64, 128) and 128 % tile.tile_n == 0
                                and tile.k_split == 1 and not (tile.grouped or tile.residual or tile.silu or tile.a_rows))
        self.tile = tile
        self.cluster_mn = (tile.cluster_m, tile.cluster_n)
        self.acc_dtype = cutlass.Float32
        # Consumer warpgroups: three for a 192-row tile, two for a 128-row one (64 rows each) but
        # 128x128 (one or two measured the same); a 64-row tile takes one. A narrow 128-row tile on
        # one warpgroup issues short wgmmas back to back (128x80: m64n80k16, ~40 tensor cycles each).
        # FP8 tiles: a warpgroup per 64 rows (the promotion's row scales follow the warps' 16-row slabs).
        wgs = 3 if tile.tile_m == 192 else 2 if tile.tile_m == 128 and tile.tile_n != 128 else 1
        wgs = tile.tile_m // 64 if tile.fp8 else wgs
        self.atom_layout_mnk = (wgs, 1, 1)
        self.num_mma_wg = math.prod(self.atom_layout_mnk)
        # Warp-specialised variants (``ws``) put a producer warpgroup first, whose warp 0 issues every
        # TMA load; otherwise warp 0 of the MMA warpgroups doubles as the producer between its wgmmas.
        self.first_mma_warp = 4 if tile.ws else 0
        # wgmma is at most n256: a 320-wide tile issues two n160 wgmmas per k-step (160 fp32
        # accumulators per thread, which fit only without a producer warpgroup)
        self.mma_n = tile.tile_n // 2 if tile.tile_n > 256 else tile.tile_n
        self.mma_threads = 128 * self.num_mma_wg
        self.threads = self.mma_threads + 32 * self.first_mma_warp
        self.buffer_align = 1024

    # ---- host-side layout setup ------------------------------------------------------------
    def _setup(self, a_dtype, c_dtype, a_layout, b_layout, c_layout):
        def tiled_mma(n):
            return sm90_utils.make_trivial_tiled_mma(
                a_dtype, a_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
                self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, n),
            )

        self.tiled_mma = tiled_mma(self.mma_n)
        k_inst = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        self.tile_mnk = (self.tile.tile_m, self.tile.tile_n, 4 * k_inst)
        # The output tile: the MMA tile, or its half for SiLU·up twins, whose epilogue stores through
        # a half-width MMA's thread layout (the same threads, half the 8-column groups)
        self.out_mnk = (self.tile.tile_m, self.tile.tile_n // 2, self.tile_mnk[2]) if self.tile.silu else self.tile_mnk
        self.epi_mma = tiled_mma(self.mma_n // 2) if self.tile.silu else self.tiled_mma
        self.cta_layout_mnk = cute.make_layout((*self.cluster_mn, self.tile.k_split))
        self.mcast_a = self.cluster_mn[1]
        self.mcast_b = self.cluster_mn[0]
        # The epilogue walks whole epi tiles: a width that 32 does not divide (80) takes 16-wide ones
        # (with 32, a 128x80 tile's second 64-row half came out wrong; with 16 it verified, 2026-12-01).
        # Epi tiles span the warpgroups' rows: 192 for three, 128 for two (cooperative).
        wgs = self.num_mma_wg
        override = (192, 32) if wgs == 3 else None if self.out_mnk[1] % 32 == 0 else (64 * wgs, 16)
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.out_mnk, c_dtype, is_cooperative=self.atom_layout_mnk == (2, 1, 1), epi_tile_override=override,
        )
        bytes_per_stage = (self.tile_mnk[0] + self.tile_mnk[1]) * self.tile_mnk[2] * a_dtype.width // 8
        # Residual variants hold the whole R tile in shared memory (loaded by TMA at tile start,
        # laid out as epi tiles like the output staging), at the cost of ring stages.
        self.n_epi = (self.out_mnk[0] // self.epi_tile[0]) * (self.out_mnk[1] // self.epi_tile[1])
        self.r_tile_bytes = self.tile_mnk[0] * self.tile_mnk[1] * c_dtype.width // 8 if self.tile.residual else 0
        r_smem = self.r_tile_bytes + self.buffer_align if self.tile.residual else 0
        self.stages = (SM90_SMEM_BYTES - 1024 - r_smem) // bytes_per_stage
        self.epi_stages = 4
        self.sa_layout = sm90_utils.make_smem_layout_a(a_layout, self.tile_mnk, a_dtype, self.stages)
        # The rows of A's tile that its TMA loads: all, or the first ``a_rows`` where M is that small
        # (a decode batch): the MMA's other rows read stale shared memory into output rows past M,
        # which are never stored, and each CTA draws a quarter (a_rows = 16) of the A bytes from L2
        self.a_box = self.tile.a_rows or self.tile_mnk[0]
        self.sa_box_layout = sm90_utils.make_smem_layout_a(a_layout, (self.a_box, *self.tile_mnk[1:]), a_dtype,
                                                           self.stages)
        self.stage_tx_bytes = (self.a_box + self.tile_mnk[1]) * self.tile_mnk[2] * a_dtype.width // 8
        self.sb_layout = sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, a_dtype, self.stages)
        self.sc_layout = sm90_utils.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile, self.epi_stages)
        self.sr_layout = (sm90_utils.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile, self.n_epi)
                          if self.tile.residual else self.sc_layout)
        # The epilogue staging buffer reuses the A ring (idle by then); it must fit inside it.
        assert cute.cosize(self.sc_layout) * c_dtype.width <= cute.cosize(self.sa_layout) * a_dtype.width, \
            f"{self.tile.name}: epilogue buffer larger than the A ring"
        # K-split pairs receive the peer's fp32 accumulators in the (idle) B ring
        assert self.tile.k_split == 1 or self.tile_mnk[0] * self.tile_mnk[1] * 32 <= \
            cute.cosize(self.sb_layout) * a_dtype.width, f"{self.tile.name}: B ring too small for the partial"

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, b_early: cutlass.Int32,
                 stream: cuda.CUstream):
        """Dense GEMM (``grouped=False`` variants)."""
        self._launch(a, b, c, c, c, b_early, stream, c, c)  # c stands in for the unused tile → expert map,
        # residual and scales

    @cute.jit
    def residual_gemm(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, r: cute.Tensor,
                      b_early: cutlass.Int32, stream: cuda.CUstream):
        """``D = A·Bᵀ + R`` (``residual=True`` variants): R is ``(M, N, 1)`` like D and may be D."""
        self._launch(a, b, c, c, r, b_early, stream, c, c)

    @cute.jit
    def grouped(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, tile_expert: cute.Tensor,
                b_early: cutlass.Int32, stream: cuda.CUstream):
        """Grouped GEMM (``grouped=True``): B is ``(N, K, E)``; M-tile ``t`` uses expert ``tile_expert[t]``."""
        self._launch(a, b, c, tile_expert, c, b_early, stream, c, c)

    @cute.jit
    def fp8_gemm(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor,
                 b_early: cutlass.Int32, stream: cuda.CUstream):
        """Block-scaled FP8 GEMM (``fp8=True``): A ``(M, K, 1)`` and B ``(N, K, 1)`` e4m3, ``sfa`` ``(M, K/128)``
        float32 MN-major (stride 1 along M), ``sfb`` ``(ceil(N/128), K/128)`` float32, D bf16."""
        self._launch(a, b, c, c, c, b_early, stream, sfa, sfb)

    @cute.jit
    def _launch(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, tile_expert: cute.Tensor,
                r: cute.Tensor, b_early: cutlass.Int32, stream: cuda.CUstream, sfa: cute.Tensor,
                sfb: cute.Tensor):
        self.a_dtype = a.element_type
        self.c_dtype = c.element_type
        self.c_layout = utils.LayoutEnum.from_tensor(c)
        self._setup(
            self.a_dtype, self.c_dtype, utils.LayoutEnum.from_tensor(a),
            utils.LayoutEnum.from_tensor(b), self.c_layout,
        )
        load_a = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if self.mcast_a == 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        load_b = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if self.mcast_b == 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_a, a, cute.slice_(self.sa_box_layout, (None, None, 0)),
            (self.a_box, self.tile_mnk[2]), num_multicast=self.mcast_a,
        )
        tma_b, tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_b, b, cute.slice_(self.sb_layout, (None, None, 0)),
            (self.tile_mnk[1], self.tile_mnk[2]), num_multicast=self.mcast_b,
        )
        tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c,
            cute.slice_(self.sc_layout, (None, None, 0)), self.epi_tile,
        )
        tma_r, tr = tma_c, tc  # placeholders unless residual
        if cutlass.const_expr(self.tile.residual):
            tma_r, tr = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), r,
                cute.slice_(self.sr_layout, (None, None, 0)), self.epi_tile,
            )
        tiles = cute.zipped_divide(c, tiler=(self.out_mnk[0], self.out_mnk[1]))
        cluster_mnl = (*self.cluster_mn, self.tile.k_split)
        clusters = cute.ceil_div(cute.get(tiles.layout, mode=[1]).shape, cluster_mnl)
        grid = tuple(x * y for x, y in zip(clusters, cluster_mnl))

        self.smem_struct = self._smem_struct()
        self.kernel(tma_a, ta, tma_b, tb, tma_c, tc, tile_expert, tma_r, tr, sfa, sfb, b_early, self.tiled_mma,
                    self.epi_mma, self.cta_layout_mnk,
                    self.sa_layout, self.sb_layout, self.sc_layout, self.sr_layout).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=cluster_mnl, stream=stream, use_pdl=True,
        )

    def _smem_struct(self):
        """Ring barriers (the last one: the R tile's), the A and B rings, and for residual variants
        the R tile. Built from evaluated annotations (this module's are strings)."""
        def buf(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], self.buffer_align]

        fields = {"bars": cute.struct.MemRange[cutlass.Int64, self.stages * 2 + 1],
                  "sa": buf(self.a_dtype, self.sa_layout), "sb": buf(self.a_dtype, self.sb_layout)}
        if self.tile.residual:
            fields["sr"] = buf(self.c_dtype, self.sr_layout)
        return cute.struct(type("Smem", (), {"__annotations__": fields}))

    # ---- device code -----------------------------------------------------------------------
    @cute.jit
    def _tile_coord(self):
        """Cluster → (tile_m, tile_n): groups of RASTER_GROUP clusters walk M before N."""
        cidx, cidy, _ = cute.arch.cluster_idx()
        cdimx, cdimy, _ = cute.arch.cluster_dim()
        linear = cidx + cdimx * cidy
        full = (cdimx // RASTER_GROUP) * RASTER_GROUP * cdimy
        cm = cidx
        cn = cidy
        if linear < full:
            group = linear // (RASTER_GROUP * cdimy)
            within = linear % (RASTER_GROUP * cdimy)
            cm = group * RASTER_GROUP + within % RASTER_GROUP
            cn = within // RASTER_GROUP
        else:
            tail_m = cdimx % RASTER_GROUP
            rest = linear - full
            cm = full // cdimy + rest % tail_m
            cn = rest // tail_m
        in_cluster = cute.arch.block_in_cluster_idx()
        return cm * self.cluster_mn[0] + in_cluster[0], cn * self.cluster_mn[1] + in_cluster[1]

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, tile_expert: cute.Tensor, tma_r: cute.CopyAtom,
               mR: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor, b_early: cutlass.Int32,
               tiled_mma: cute.TiledMma, epi_mma: cute.TiledMma,
               cta_layout_mnk: cute.Layout, sa_layout: cute.ComposedLayout,
               sb_layout: cute.ComposedLayout, sc_layout: cute.ComposedLayout, sr_layout: cute.ComposedLayout):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        _, _, batch = cute.arch.block_idx()
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        pid_m, pid_n = self._tile_coord()
        coord = (pid_m, pid_n, None, 0)  # A (and B unless grouped): batch mode of extent 1
        coord_b = coord
        if cutlass.const_expr(self.tile.grouped):  # the expert map may come from the previous kernel
            cute.arch.griddepcontrol_wait()
            coord_b = (pid_m, pid_n, None, tile_expert[pid_m])
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(rank)
        mask_a = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        mask_b = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        mask_a = mask_a if self.mcast_a > 1 else 0
        mask_b = mask_b if self.mcast_b > 1 else 0
        stage_bytes = self.stage_tx_bytes  # (a multicast tile counts whole in every receiving CTA)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        consumers = (self.mcast_a + self.mcast_b - 1) * (self.mma_threads // 32)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        r_bar = storage.bars.data_ptr() + self.stages * 2
        if cutlass.const_expr(self.tile.residual):
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(r_bar, 1)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sB = storage.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, sc_layout.inner, dtype=self.c_dtype), sc_layout.outer)
        sA_box = sA  # the rows of each stage that A's TMA writes
        if cutlass.const_expr(self.a_box != self.tile_mnk[0]):
            sA_box = cute.local_tile(sA, (self.a_box, self.tile_mnk[2]), (0, 0, None))
        sR = sC  # placeholder unless residual
        if cutlass.const_expr(self.tile.residual):
            sR = storage.sr.get_tensor(sr_layout.outer, swizzle=sr_layout.inner)

        # (a_box, bK, k_tiles); a_rows variants run with M <= a_rows: one M-tile, pid_m = 0
        gA = cute.local_tile(mA, (self.a_box, *self.tile_mnk[1:]), coord, proj=(1, None, 1))
        gB = cute.local_tile(mB, self.tile_mnk, coord_b, proj=(None, 1, 1))  # (bN, bK, k_tiles)
        out_slice = batch if self.tile.k_split == 1 else 0  # a K pair writes one output slice
        gC = cute.local_tile(mC, self.out_mnk, (pid_m, pid_n, None, out_slice), proj=(1, 1, None))  # (bM, bN out)

        is_mma = warp >= self.first_mma_warp
        mma_tidx = tidx - 32 * self.first_mma_warp  # (negative in the producer warpgroup)
        wg = cute.arch.make_warp_uniform(cutlass.max(mma_tidx, 0) // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.num_mma_wg, stride=128)(wg))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, cluster_coord[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA_box, 0, 2), cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
        )
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_shape = (tiled_mma.partition_shape_C(self.tile_mnk[:2]) if self.tile.silu
                     else thr_mma.partition_C(gC).shape)
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
        k_total = cute.size(gA, mode=[2])
        splits = cute.size(mC, mode=[2]) if self.tile.k_split == 1 else self.tile.k_split
        k_per_split = (k_total + splits - 1) // splits
        k_first = batch * k_per_split  # the launcher sizes S so that every split is non-empty
        k_tiles = cutlass.min(k_per_split, k_total - k_first)
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        # Launched as a programmatic dependent launch: until griddepcontrol.wait the previous kernel may
        # still be running, so A, R and D are touched only after it. With b_early the weights' loads of
        # the ring fill go out before the wait (the caller vouches that the previous kernel does not
        # write B), so a GEMM in a chain streams its weights while its predecessor finishes.
        fill = cutlass.min(self.stages, k_tiles)
        if warp == 0:
            for _ in cutlass.range(fill, unroll=1):
                ring.producer_acquire(produce)
                if b_early != 0:
                    self._copy_tile(tma_b, tBgB, tBsB, mask_b, ring, produce, k_first)
                produce.advance()
        cute.arch.griddepcontrol_wait()
        if warp == 0:
            filled = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for _ in cutlass.range(fill, unroll=1):
                self._copy_tile(tma_a, tAgA, tAsA, mask_a, ring, filled, k_first)
                if b_early == 0:
                    self._copy_tile(tma_b, tBgB, tBsB, mask_b, ring, filled, k_first)
                ring.producer_commit(filled)
                filled.advance()
            if cutlass.const_expr(self.tile.residual):
                # only the CTA that runs the epilogue loads R: no CTA exits with an R load in flight
                if self.tile.k_split == 1 or batch == 0:
                    self._load_residual(tma_r, mR, sR, r_bar, pid_m, pid_n)
        # Let the next kernel launch now (its CTAs take SMs as ours retire), except from a 256-wide
        # grid that leaves SMs idle: there the next kernel's early CTAs made chains of weight
        # streams 15-20% slower (4B.gate_up at M = 1, 76 CTAs: 36.7 against 30.1 µs), while a
        # 128-wide one gained (4B.qkv at M = 128, 96 CTAs: 13.3 against 15.0 µs; 2026-12-01).
        gx, gy, gz = cute.arch.grid_dim()
        if self.tile.tile_n < 256 or gx * gy * gz * 10 >= 9 * H200_SMS:
            cute.arch.griddepcontrol_launch_dependents()
        stage_args = (k_first, tma_a, tAgA, tAsA, mask_a, tma_b, tBgB, tBsB, mask_b)
        if cutlass.const_expr(self.tile.fp8):  # the consumers end their tiles in their own branch
            self._scaled_roles(warp, ring, read, produce, fill, k_tiles, stage_args, tiled_mma, acc, frag_a, frag_b,
                               mSFA, mSFB, pid_m, pid_n, mma_tidx, (sC, gC, tma_c, sR, r_bar))
        else:
            if cutlass.const_expr(self.tile.ws):
                if warp == 0:
                    self._stream_rest(ring, produce, fill, k_tiles, stage_args)
                if is_mma:
                    self._mma_mainloop(ring, read, release, produce, k_tiles, warp, tiled_mma, acc, frag_a, frag_b,
                                       stage_args)
            else:
                self._mma_mainloop(ring, read, release, produce, k_tiles, warp, tiled_mma, acc, frag_a, frag_b,
                                   stage_args)
            if cute.size(self.cluster_mn) > 1:  # peers may still multicast into our smem
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            else:
                cute.arch.sync_threads()
            if cutlass.const_expr(self.tile.k_split == 2):
                self._add_peer_partial(acc, storage.sb.data_ptr(), batch, mma_tidx, is_mma)
            if is_mma:
                if cutlass.const_expr(self.tile.silu):
                    act = cute.make_rmem_tensor(epi_mma.partition_shape_C(self.out_mnk[:2]), self.acc_dtype)
                    self._silu_up(acc, act)
                    self._epilogue(mma_tidx, warp, epi_mma, act, sC, gC, tma_c, sR, r_bar)
                elif batch == 0 or self.tile.k_split == 1:
                    self._epilogue(mma_tidx, warp, tiled_mma, acc, sC, gC, tma_c, sR, r_bar)

    @cute.jit
    def _mma_mainloop(self, ring, read, release, produce, k_tiles, warp, tiled_mma, acc, frag_a, frag_b, stage_args):
        """The MMA warpgroups' k loop: wait for a stage, issue its wgmmas, free the stage of the
        batch before; without a producer warpgroup, warp 0 then refills the stage just freed."""
        k_blocks = cute.size(frag_a, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        if cutlass.const_expr(self.tile.k_split == 2):  # K <= 64: the second half is empty, its sums 0
            acc.fill(0.0)
        for k in cutlass.range(k_tiles, unroll=1):
            ring.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range(k_blocks, unroll_full=True):
                blk = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, frag_a[blk], frag_b[blk], acc)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            read.advance()
            if k > 0:  # keep one wgmma batch in flight; free the stage of the one before
                cute.nvgpu.warpgroup.wait_group(1)
                ring.consumer_release(release)
                release.advance()
                # refill the stage just freed (never before a release: the ring is full)
                if cutlass.const_expr(not self.tile.ws):
                    if warp == 0 and produce.count < k_tiles:
                        self._load_stage(ring, produce, *stage_args)
                        produce.advance()
        cute.nvgpu.warpgroup.wait_group(0)  # the last stage needs no release: nothing refills it

    @cute.jit
    def _stream_rest(self, ring, produce, fill, k_tiles, stage_args):
        """The producer warp of a warp-specialised variant: the k-tiles after the ring fill, as stages free up."""
        for _ in cutlass.range(fill, k_tiles, unroll=1):
            self._load_stage(ring, produce, *stage_args)
            produce.advance()

    @cute.jit
    def _load_stage(self, ring, state, k_first, tma_a, tAgA, tAsA, mask_a, tma_b, tBgB, tBsB, mask_b):
        ring.producer_acquire(state)
        self._copy_tile(tma_a, tAgA, tAsA, mask_a, ring, state, k_first)
        self._copy_tile(tma_b, tBgB, tBsB, mask_b, ring, state, k_first)
        ring.producer_commit(state)

    @cute.jit
    def _copy_tile(self, tma, g, s, mask, ring, state, k_first):
        """One operand's k-tile ``k_first + state.count`` into ring stage ``state.index``."""
        cute.copy(tma, g[(None, k_first + state.count)], s[(None, state.index)],
                  tma_bar_ptr=ring.producer_get_barrier(state), mcast_mask=mask)
