"""The Hopper GEMM's block-scaled FP8 mainloop (``GemmSm90`` inherits it; its ``fp8`` twins run it):

    D[m, n] = sum_kt  sfa[m, kt] · sfb[n // 128, kt] · (A[m, kt·128 : kt·128 + 128] · B[n, kt·128 : kt·128 + 128])

A [M, K] and B [N, K] e4m3 (the activations quantized per token and 128-group by raw_cuda/fp8_quant.cu, the
weights as a ``quant_method fp8`` checkpoint with ``weight_block_size [128, 128]`` holds them), sfa float32
MN-major ``[K/128][ld]`` (DeepGEMM's layout), sfb float32 ``[ceil(N/128), K/128]`` (``weight_scale_inv``).
The idea is DeepGEMM's: Hopper's FP8 wgmma accumulates with fewer bits than float32, so each 128-wide k-tile
(one pipeline stage: four m64nNk32 wgmmas) starts a fresh partial accumulator, and once its wgmmas are done
the partial is promoted into the float32 total with the tile's scale products ``sfa[m, kt] · sfb[n // 128, kt]``.
A consumer thread's accumulators lie on two rows (its warp's 16-row slab: lane // 4 and + 8, wgmma's D layout),
so it loads two A scales and one B scale per k-tile (a tile's columns lie in one 128-wide scale block: tile_n
divides 128).

Overlap: two partial accumulators alternate between the k-tiles. A warpgroup issues k-tile i's wgmmas into one,
then waits for all but that latest batch (``wait_group(1)``: k-tile i - 1's wgmmas), frees i - 1's stage and
promotes its partial while i's wgmmas run; the tensor cores always hold a queued batch instead of draining at
every k-tile (the former loop waited for each k-tile's own wgmmas, so its promotion and the refill of the wgmma
queue serialised with the math: 765-845 TFLOP/s on the H100, the bf16 rate). A k-tile's scales load when its
wgmmas are issued and are used a k-tile later, so their latency hides behind one batch. The two partials are
fixed registers, so the loop walks k-tiles in pairs (the odd last one after it).
Registers: total + two partials are 3·tile_n/2 fp32 a thread (192 on 128-column tiles); two consumer
warpgroups and a producer one are 384 threads (168 registers each at launch), so the producer gives registers
to the consumers (``setmaxnreg`` 40 / 232). The same bound rules out wider tiles: 128x256 (two B scale blocks
a tile) needs 384 accumulator registers a thread, more than the 255 a thread can hold, and 256x128 puts four
consumer warpgroups in 640 threads (~100 registers each).
Roofline (H100 SXM): ``2·M·N·K`` flops at ~1,979 dense FP8 TFLOP/s (twice bf16) against ``M·K + N·K + 2·M·N``
bytes at ~3.35 TB/s: the weight read (N·K bytes: 2·M flop a byte) bounds it below M ≈ 300, the tensor cores
above.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .gemm_sm90_epilogue import EPILOGUE_BARRIER

SCALE_BLOCK = 128
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # 128·40 + 256·232 ≤ 64 Ki registers (two consumer warpgroups)


class BlockScaledMainloopSm90:
    """Mixin of GemmSm90: the FP8 twins' mainloop (warp-specialised: the producer warpgroup fills the ring)."""

    @cute.jit
    def _scaled_roles(self, warp, ring, read, produce, fill, k_tiles, stage_args, tiled_mma, acc, frag_a, frag_b,
                      mSFA: cute.Tensor, mSFB: cute.Tensor, pid_m, pid_n, mma_tidx, epilogue_args):
        """The producer warpgroup (warps 0-3; warp 0 streams the k-tiles) and the consumers (mainloop, then
        epilogue). With two consumer warpgroups the producer hands them registers (setmaxnreg) first: the
        consumers' ``inc`` waits for the producer's ``dec``. The consumers' whole path sits in the branch of the
        ``inc``, which is what ptxas allocates it (after the branches join it would have 168 a thread and spill
        the total), so they sync on a named barrier (every consumer done reading the A ring, which the
        epilogue's staging buffer reuses) instead of the CTA-wide one. In a cluster (the weight tile multicast to
        an M-pair) every thread arrives on the cluster barrier once done with its peers' barriers and waits on it
        before leaving; the consumers' epilogue runs in between (their own smem: every load into it has landed)."""
        clustered = cute.size(self.cluster_mn) > 1
        if warp < 4:
            if cutlass.const_expr(self.num_mma_wg == 2):
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self._stream_rest(ring, produce, fill, k_tiles, stage_args)
            if cutlass.const_expr(clustered):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
        else:
            if cutlass.const_expr(self.num_mma_wg == 2):
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._scaled_mainloop(ring, read, k_tiles, stage_args[0], tiled_mma, acc, frag_a, frag_b, mSFA, mSFB,
                                  pid_m, pid_n, mma_tidx)
            if cutlass.const_expr(clustered):  # our stage releases (arrivals on the peers' barriers) are done
                cute.arch.cluster_arrive()
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.mma_threads)
            self._epilogue(mma_tidx, warp, tiled_mma, acc, *epilogue_args)
            if cutlass.const_expr(clustered):  # no CTA leaves while a peer may still arrive on its barriers
                cute.arch.cluster_wait()

    @cute.jit
    def _scaled_mainloop(self, ring, read, k_tiles, k_first, tiled_mma, acc, frag_a, frag_b, mSFA: cute.Tensor,
                         mSFB: cute.Tensor, pid_m, pid_n, mma_tidx):
        """acc = the promoted sum over this CTA's k-tiles (mSFA ``(M, K/128)``, mSFB ``(ceil(N/128), K/128)``).
        The pipeline states and the MMA advance here, not in the helpers: the DSL carries through a loop only
        what the loop body itself calls or assigns."""
        parts = (cute.make_rmem_tensor(acc.shape, self.acc_dtype), cute.make_rmem_tensor(acc.shape, self.acc_dtype))
        scales = (cute.make_rmem_tensor(3, cutlass.Float32), cute.make_rmem_tensor(3, cutlass.Float32))
        acc.fill(0.0)
        last_row = cute.size(mSFA, mode=[0]) - 1
        row = pid_m * self.tile_mnk[0] + (mma_tidx // 32) * 16 + (mma_tidx % 32) // 4   # MMA warp w: rows 16w ..
        rows = (cutlass.min(row, last_row), cutlass.min(row + 8, last_row))             # rows past M: any scale
        src = (mSFA, mSFB, rows, pid_n * self.tile_mnk[1] // SCALE_BLOCK)
        release = read.clone()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        self._issue_k_tile(ring, read, tiled_mma, parts[0], frag_a, frag_b, scales[0], src, k_first)
        read.advance()
        for pair in cutlass.range((k_tiles - 1) // 2, unroll=1):
            for i in cutlass.range_constexpr(2):   # k-tile 2·pair + 1 + i into partial 1 - i, promote partial i
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                self._issue_k_tile(ring, read, tiled_mma, parts[1 - i], frag_a, frag_b, scales[1 - i], src,
                                   k_first + 2 * pair + 1 + i)
                read.advance()
                self._promote(ring, release, acc, parts[i], scales[i], 1)
                release.advance()
        if k_tiles % 2 == 0:   # an even count: the last k-tile goes to partial 1
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            self._issue_k_tile(ring, read, tiled_mma, parts[1], frag_a, frag_b, scales[1], src, k_first + k_tiles - 1)
            self._promote(ring, release, acc, parts[0], scales[0], 1)
            release.advance()
            self._promote(ring, release, acc, parts[1], scales[1], 0)
        else:
            self._promote(ring, release, acc, parts[0], scales[0], 0)

    @cute.jit
    def _issue_k_tile(self, ring, read, tiled_mma, part, frag_a, frag_b, scales, src, kt):
        """Wait for stage ``read``, issue its wgmmas into ``part`` (fresh: the caller cleared ACCUMULATE) as one
        batch, load k-tile kt's scales (B's of the tile's columns, A's of the thread's two rows)."""
        ring.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range(cute.size(frag_a, mode=[2]), unroll_full=True):
            blk = (None, None, kb, read.index)
            cute.gemm(tiled_mma, part, frag_a[blk], frag_b[blk], part)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        mSFA, mSFB, rows, n_block = src
        scales[0] = mSFB[n_block, kt]
        scales[1] = mSFA[rows[0], kt]
        scales[2] = mSFA[rows[1], kt]

    @cute.jit
    def _promote(self, ring, release, acc, part, scales, in_flight: cutlass.Constexpr[int]):
        """Wait until at most ``in_flight`` wgmma batches are pending (the oldest, ``part``'s, is then done), free
        stage ``release`` and add ``part`` times (B's scale · A's of the row) into acc."""
        cute.nvgpu.warpgroup.wait_group(in_flight)
        ring.consumer_release(release)
        scale_lo, scale_hi = scales[1] * scales[0], scales[2] * scales[0]
        # flat accumulator v: column pair v % 2, row half (v // 2) % 2, 8-column group v // 4
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc[v] = acc[v] + part[v] * (scale_hi if (v // 2) % 2 else scale_lo)
