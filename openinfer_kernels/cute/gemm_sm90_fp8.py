"""The Hopper GEMM's block-scaled FP8 mainloop (``GemmSm90`` inherits it; its ``fp8`` twins run it):

    D[m, n] = sum_kt  sfa[m, kt] · sfb[n // 128, kt] · (A[m, kt·128 : kt·128 + 128] · B[n, kt·128 : kt·128 + 128])

A [M, K] and B [N, K] e4m3 (the activations quantized per token and 128-group by raw_cuda/fp8_quant.cu, the
weights as a ``quant_method fp8`` checkpoint with ``weight_block_size [128, 128]`` holds them), sfa float32
MN-major ``[K/128][ld]`` (DeepGEMM's layout), sfb float32 ``[ceil(N/128), K/128]`` (``weight_scale_inv``).
The idea is DeepGEMM's: Hopper's FP8 wgmma accumulates with fewer bits than float32, so each 128-wide k-tile
(one pipeline stage: four m64nNk32 wgmmas) starts a fresh accumulator, is waited for, and is promoted into
the float32 total with the tile's scale products ``sfa[m, kt] · sfb[n // 128, kt]``. A consumer thread's
accumulators lie on two rows (its warp's 16-row slab: lane // 4 and + 8, wgmma's D layout), so it loads two
A scales and one B scale per k-tile (a tile's columns lie in one 128-wide scale block: tile_n divides 128),
those of the next k-tile while the current one's wgmmas run. The wait for each k-tile's wgmmas serialises a warpgroup's tensor
work with its promotion; with two consumer warpgroups (128-row tiles) one promotes while the other multiplies.
Roofline (H200): ``2·M·N·K`` flops at ~1,580 dense FP8 TFLOP/s (twice bf16) against ``M·K + N·K + 2·M·N``
bytes at ~4.8 TB/s: the weight read (N·K bytes: 2·M flop a byte) bounds it below M ≈ 165, the tensor cores
above.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

SCALE_BLOCK = 128


class BlockScaledMainloopSm90:
    """Mixin of GemmSm90: the FP8 twins' mainloop (warp-specialised: the producer warpgroup fills the ring)."""

    @cute.jit
    def _scaled_mainloop(self, ring, read, k_tiles, k_first, tiled_mma, acc, frag_a, frag_b, mSFA: cute.Tensor,
                         mSFB: cute.Tensor, pid_m, pid_n, mma_tidx):
        """acc = the promoted sum over this CTA's k-tiles (mSFA ``(M, K/128)``, mSFB ``(ceil(N/128), K/128)``)."""
        part = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        acc.fill(0.0)
        k_blocks = cute.size(frag_a, mode=[2])
        last_row = cute.size(mSFA, mode=[0]) - 1
        row = pid_m * self.tile_mnk[0] + (mma_tidx // 32) * 16 + (mma_tidx % 32) // 4   # MMA warp w: rows 16w ..
        row_lo, row_hi = cutlass.min(row, last_row), cutlass.min(row + 8, last_row)     # rows past M: any scale
        n_block = pid_n * self.tile_mnk[1] // SCALE_BLOCK
        scales = cute.make_rmem_tensor((2, 3), cutlass.Float32)   # [this / next k-tile][b, a of row lo, a of row hi]
        self._load_scales(scales, 0, mSFA, mSFB, row_lo, row_hi, n_block, k_first)
        for k in cutlass.range(k_tiles, unroll=1):
            ring.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            for kb in cutlass.range(k_blocks, unroll_full=True):
                blk = (None, None, kb, read.index)
                cute.gemm(tiled_mma, part, frag_a[blk], frag_b[blk], part)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            # the next k-tile's scales load while the wgmmas run (the last tile loads its own again)
            self._load_scales(scales, 1, mSFA, mSFB, row_lo, row_hi, n_block, k_first + cutlass.min(k + 1, k_tiles - 1))
            cute.nvgpu.warpgroup.wait_group(0)
            ring.consumer_release(read)
            read.advance()
            scale_lo, scale_hi = scales[0, 1] * scales[0, 0], scales[0, 2] * scales[0, 0]
            # flat accumulator v: column pair v % 2, row half (v // 2) % 2, 8-column group v // 4
            for v in cutlass.range_constexpr(cute.size(acc)):
                acc[v] = acc[v] + part[v] * (scale_hi if (v // 2) % 2 else scale_lo)
            for i in cutlass.range_constexpr(3):
                scales[0, i] = scales[1, i]

    @cute.jit
    def _load_scales(self, scales, slot, mSFA: cute.Tensor, mSFB: cute.Tensor, row_lo, row_hi, n_block, kt):
        """scales[slot] = (B's scale of the tile's columns, A's of the thread's two rows) at k-tile kt."""
        scales[slot, 0] = mSFB[n_block, kt]
        scales[slot, 1] = mSFA[row_lo, kt]
        scales[slot, 2] = mSFA[row_hi, kt]
