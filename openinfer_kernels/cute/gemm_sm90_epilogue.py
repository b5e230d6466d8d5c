"""The Hopper GEMM's tile ends (``GemmSm90`` inherits them): the epilogue, the residual tile's load,
a K-split pair's partial-sum exchange and the SiLU·up of gate_up twins.

They run on the MMA warpgroups only. ``mma_tidx`` is a thread's index among them (``mma_threads``
in all), ``first_mma_warp`` the first of their warps (4 when a producer warpgroup comes first).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

from .dsmem import peer_address, store_f32x4

EPILOGUE_BARRIER = 1  # named barrier of the MMA threads (0 is the CTA-wide one)


class EpilogueSm90:
    """Mixin of GemmSm90: everything after the mainloop."""

    @cute.jit
    def _add_peer_partial(self, acc, ring_b, rank, mma_tidx, is_mma):
        """K-split pair: rank 1 stores its fp32 accumulators into rank 0's B ring over distributed
        shared memory, four at a time (accumulators ``4j … 4j+3`` of MMA thread ``t`` at word
        ``4·(j·mma_threads + t)``: 16-byte stores, consecutive threads on consecutive banks); rank 0
        adds them to its own. Cluster barriers (every thread of both CTAs) before (both mainloops
        done, the rings idle) and after (release / acquire: the stores are visible)."""
        n_acc = cute.size(acc)
        threads = self.mma_threads
        buf = cute.make_tensor(cute.recast_ptr(ring_b, dtype=self.acc_dtype), cute.make_layout(n_acc * threads))
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if rank == 1 and is_mma:
            peer = peer_address(buf.iterator, 0) + mma_tidx * 16
            for j in cutlass.range_constexpr(n_acc // 4):
                store_f32x4(peer + j * threads * 16, [acc[4 * j + i] for i in range(4)])
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if rank == 0 and is_mma:
            for v in cutlass.range_constexpr(n_acc):
                acc[v] = acc[v] + buf[4 * ((v // 4) * threads + mma_tidx) + v % 4]

    @cute.jit
    def _load_residual(self, tma_r, mR, sR, r_bar, pid_m, pid_n):
        """TMA the whole R tile into sR, one epi tile per stage of sR, on the barrier r_bar
        (zeros past M and N). Issued by the producer after the ring fill: it overlaps the mainloop."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(r_bar, self.r_tile_bytes)
        gR = cute.zipped_divide(cute.local_tile(mR, self.tile_mnk, (pid_m, pid_n, None, 0), proj=(1, 1, None)),
                                self.epi_tile)
        dst_s, src_g = cute.nvgpu.cpasync.tma_partition(
            tma_r, 0, cute.make_layout(1), cute.group_modes(sR, 0, 2), gR)
        order = self._epi_order(gR)
        for e in cutlass.range_constexpr(self.n_epi):
            cute.copy(tma_r, src_g[(None, order.get_hier_coord(e))], dst_s[(None, e)], tma_bar_ptr=r_bar)

    @cute.jit
    def _silu_up(self, acc, act):
        """SiLU·up twins: ``act = bf16(SiLU(gate))·up`` of the gate_up product, B's rows interleaved in
        blocks of 8 (gate, up, gate, ...: ``gpu_gemm.interleave_gate_up``). A wgmma accumulator
        holds a thread's values as (2 columns, 2 rows, 8-column groups), so groups 2j (gate) and
        2j + 1 (up) of one thread are the gate and up of the outputs its half-width fragment holds
        in group j: flat value i of ``act`` takes acc values 8·(i // 4) + i % 4 and 4 after it (both
        fragments compact, column-major). The arithmetic of silu_mul.cu (gate and up rounded to
        bf16, ``__expf``, ``__fdividef``: an IEEE division takes a slow path on the NaN / Inf of
        rows past M, which a_rows tiles compute from stale shared memory); the epilogue rounds."""
        for i in cutlass.range_constexpr(cute.size(act)):
            gate = acc[8 * (i // 4) + i % 4].to(self.c_dtype).to(self.acc_dtype)
            up = acc[8 * (i // 4) + i % 4 + 4].to(self.c_dtype).to(self.acc_dtype)
            silu = gate * cute.arch.rcp_approx(1.0 + cute.math.exp(-gate, fastmath=True))
            act[i] = silu.to(self.c_dtype).to(self.acc_dtype) * up

    def _epi_order(self, g_epi):
        """Epi tile e → its (m, n) coordinate in the tile: row-major over the epi grid."""
        epi_shape = g_epi.shape[1]
        return cute.make_layout(epi_shape, stride=(epi_shape[1], 1))

    @cute.jit
    def _epilogue(self, mma_tidx, warp, tiled_mma, acc, sC, gC, tma_c, sR, r_bar):
        """Registers → smem (converted) → TMA store, one epi_tile at a time, 4-deep; the first MMA
        warp issues the stores. Residual variants add R, read from sR with ldmatrix (the inverse of
        the stmatrix store, so each thread gets R at its own accumulators' positions), in fp32
        before the rounding."""
        store_warp = warp == self.first_mma_warp
        store_atom = sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype)
        c_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype)
        r2s = cute.make_tiled_copy_S(store_atom, cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
        thr_r2s = r2s.get_slice(mma_tidx)
        dst = thr_r2s.partition_D(sC)
        acc_view = r2s.retile(acc)
        frag_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
        frag = cute.make_rmem_tensor_like(frag_layout, self.acc_dtype)
        n_frag = cute.size(frag)
        gC_epi = cute.zipped_divide(gC, self.epi_tile)
        src_s, dst_g = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
        n_epi = cute.size(gC_epi, mode=[1])
        epi_order = self._epi_order(gC_epi)
        s2r, src_r = r2s, dst  # placeholders unless residual
        if cutlass.const_expr(self.tile.residual):
            load_atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                                            self.c_dtype)
            s2r = cute.make_tiled_copy_S(load_atom, cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
            src_r = s2r.get_slice(mma_tidx).partition_S(sR)
            cute.arch.mbarrier_wait(r_bar, 0)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads),
        )
        for e in cutlass.range_constexpr(n_epi):
            for v in cutlass.range_constexpr(n_frag):
                frag[v] = acc_view[e * n_frag + v]
            if cutlass.const_expr(self.tile.residual):
                res = cute.make_rmem_tensor_like(frag_layout, self.c_dtype)
                cute.copy(s2r, src_r[(None, None, None, e)], s2r.retile(res))
                for v in cutlass.range_constexpr(n_frag):
                    frag[v] = frag[v] + res[v].to(self.acc_dtype)
            out = cute.make_rmem_tensor_like(frag_layout, self.c_dtype)
            out.store(frag.load().to(self.c_dtype))
            buf = e % cute.size(dst, mode=[3])
            cute.copy(r2s, out, dst[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.mma_threads)
            if store_warp:
                cute.copy(tma_c, src_s[(None, buf)], dst_g[(None, epi_order.get_hier_coord(e))])
                stores.producer_commit()
                stores.producer_acquire()
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.mma_threads)
        if store_warp:
            stores.producer_tail()
