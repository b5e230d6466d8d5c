"""Causal prefill attention over variable-length sequences, GQA, head_dim 128, Hopper (CuTe DSL).

``O[t, h] = softmax(scale · Q[t, h] · K[s, h/g]ᵀ + causal) · V[s, h/g]`` for every token t of every
sequence, where sequence b owns query rows ``cu_q[b] : cu_q[b+1]`` and key/value rows
``cu_k[b] : cu_k[b+1]``; a sequence with more keys than queries (a cached prefix) aligns its queries
with its last keys (query i sees keys ``≤ i + len_k - len_q``). ``g = Hq / Hkv``.

K and V are read from **contiguous** ``[tokens, Hkv, 128]`` buffers, not from the paged cache: the
prefill writes its new K/V into those buffers anyway before the paged write, TMA needs one
descriptor per tensor (a paged gather would need per-block descriptors or cp.async), and a cached
prefix is one contiguous gather per sequence. One launch covers all sequences through a host-built
work list of ``(sequence, 128-row query tile)`` pairs, longest sequences first (causal tiles differ
in cost), grid ``(tiles, Hq, 2)``: the z index picks the 64-row half of the tile (the list is shared
with ``attention_ws_sm90``, whose CTAs own all 128 rows).

FlashAttention-2 schedule on Hopper instructions: one warpgroup per CTA owns 64 query rows; Q is
loaded once by TMA, K and V tiles of 128 keys stream through a 3-stage TMA/mbarrier ring (warp 0
issues the copies); ``S = Q·Kᵀ`` is a shared-memory wgmma, the online softmax runs in registers
(quad shuffles for row max/sum, exp2), P is converted in registers to the A operand of the
register-sourced ``O += P·V`` wgmma. Only tiles crossing the diagonal or the key end are masked.
Rows are written with predicated stores (a tile may overhang its sequence).

Roofline on the H200: causal flops ``2·2·Σ len_q·len_k/2·128·Hq`` at ~790 TFLOP/s; each K/V tile
feeds 64 query rows (64 flop/B: the K/V reuse across a head's CTAs comes from L2). Not
warp-specialised and without softmax/wgmma overlap, it measured 327 / 400 TFLOP/s at 4k / 16k
tokens (2026-12-01); ``attention_ws_sm90`` (the FlashAttention-3 schedule, 505 / 578) is the
default, this kernel the fallback. Its helpers (mask, softmax, store) serve both.
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

HEAD_DIM = 128
TILE_Q = 64
TILE_KV = 128
KV_STAGES = 3


class VarlenAttentionSm90:
    """jit entry: ``(q, k, vt, o, cu_q, cu_k, work, stream)``; see the module docstring. The mask,
    softmax and store helpers take the head dim from ``self`` (this kernel itself is built for 128)."""

    def __init__(self, head_dim: int = HEAD_DIM):
        self.head_dim = head_dim
        self.scale_log2 = math.log2(math.e) / math.sqrt(head_dim)

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, vt: cute.Tensor, o: cute.Tensor,
                 cu_q: cute.Tensor, cu_k: cute.Tensor, work: cute.Tensor, stream: cuda.CUstream):
        bf16 = q.element_type
        self.dtype = bf16
        qk_tile = (TILE_Q, TILE_KV, HEAD_DIM)
        pv_tile = (TILE_Q, HEAD_DIM, TILE_KV)
        self.qk_mma = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), tiler_mn=(TILE_Q, TILE_KV))
        self.pv_mma = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, utils.LayoutEnum.from_tensor(vt).sm90_mma_major_mode(),
            cutlass.Float32, (1, 1, 1), tiler_mn=(TILE_Q, HEAD_DIM), a_source=warpgroup.OperandSource.RMEM)
        self.sq_layout = sm90_utils.make_smem_layout_a(utils.LayoutEnum.from_tensor(q), qk_tile, bf16, 1)
        self.sk_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.from_tensor(k), qk_tile, bf16, KV_STAGES)
        self.sv_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.from_tensor(vt), pv_tile, bf16, KV_STAGES)
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tq = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, q, cute.slice_(self.sq_layout, (None, None, 0)), (TILE_Q, HEAD_DIM))
        tma_k, tk = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, k, cute.slice_(self.sk_layout, (None, None, 0)), (TILE_KV, HEAD_DIM))
        tma_v, tv = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, vt, cute.slice_(self.sv_layout, (None, None, 0)), (HEAD_DIM, TILE_KV))

        @cute.struct
        class Smem:
            q_bar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_bar: cute.struct.MemRange[cutlass.Int64, KV_STAGES * 2]
            sq: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.sq_layout)], 1024]
            sk: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.sk_layout)], 1024]
            sv: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.sv_layout)], 1024]

        self.smem_struct = Smem
        grid = (cute.size(work, mode=[0]), cute.size(q, mode=[2]), 2)
        self.kernel(tma_q, tq, tma_k, tk, tma_v, tv, o, cu_q, cu_k, work, self.qk_mma, self.pv_mma,
                    self.sq_layout, self.sk_layout, self.sv_layout).launch(
            grid=grid, block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mVt: cute.Tensor, mO: cute.Tensor, cu_q: cute.Tensor,
               cu_k: cute.Tensor, work: cute.Tensor, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
               sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
               sv_layout: cute.ComposedLayout):
        item, head, half = cute.arch.block_idx()
        warp = self._prefetch_descriptors(tma_q, tma_k, tma_v)
        tidx, _, _ = cute.arch.thread_idx()
        seq = work[item, 0]
        q_first = (work[item, 1] * 2 + half) * TILE_Q  # first query row of this CTA, within the sequence
        q_start, k_start = cu_q[seq], cu_k[seq]
        len_q, len_k = cu_q[seq + 1] - q_start, cu_k[seq + 1] - k_start
        shift = len_k - len_q  # query i sees keys <= i + shift
        kv_head = head // (cute.size(mQ, mode=[2]) // cute.size(mK, mode=[2]))
        kv_end = cutlass.min(q_first + TILE_Q + shift, len_k)
        if q_first >= len_q:  # the second half of a sequence's last tile may be empty
            kv_end = 0
        n_kv = (kv_end + TILE_KV - 1) // TILE_KV

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        q_ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_bar.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=cute.size_in_bytes(self.dtype, cute.slice_(sq_layout, (None, None, 0))),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        kv_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sk_layout, (None, None, 0))) + \
            cute.size_in_bytes(self.dtype, cute.slice_(sv_layout, (None, None, 0)))
        kv_ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_bar.data_ptr(), num_stages=KV_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=kv_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sq.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = storage.sk.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        sV = storage.sv.get_tensor(sv_layout.outer, swizzle=sv_layout.inner)
        # This sequence's rows of this head, as (rows, 128) / (128, keys) tiles.
        gQ = cute.local_tile(cute.domain_offset((q_start + q_first, 0), mQ[None, None, head]),
                             (TILE_Q, HEAD_DIM), (0, None))
        gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, None, kv_head]),
                             (TILE_KV, HEAD_DIM), (None, 0))
        gV = cute.local_tile(cute.domain_offset((0, k_start), mVt[None, None, kv_head]),
                             (HEAD_DIM, TILE_KV), (0, None))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cute.nvgpu.cpasync.tma_partition(
            tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cute.nvgpu.cpasync.tma_partition(
            tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cute.nvgpu.cpasync.tma_partition(
            tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        qk_thr = qk_mma.get_slice(tidx)
        pv_thr = pv_mma.get_slice(tidx)
        frag_q = qk_mma.make_fragment_A(qk_thr.partition_A(sQ))
        frag_k = qk_mma.make_fragment_B(qk_thr.partition_B(sK))
        frag_v = pv_mma.make_fragment_B(pv_thr.partition_B(sV))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((TILE_Q, TILE_KV)))
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((TILE_Q, HEAD_DIM)))
        acc_o.fill(0.0)
        row_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((2,), cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            row_max[r] = -cutlass.Float32.inf
            row_sum[r] = 0.0

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        if warp == 0:
            q_ring.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ[(None, 0)], tQsQ[(None, 0)], tma_bar_ptr=q_ring.producer_get_barrier(q_state))
            for _ in cutlass.range(cutlass.min(KV_STAGES, n_kv), unroll=1):
                self._load_kv(kv_ring, produce, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV)
                produce.advance()
        q_ring.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        # Per thread: rows lane/4 + 16·warp (+8), columns 2·(lane%4) + 8·j (+1) of each 64-row tile.
        lane = tidx % 32
        my_row = (tidx // 32) * 16 + lane // 4
        my_col = 2 * (lane % 4)
        for kv in cutlass.range(n_kv, unroll=1):
            kv_ring.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(frag_q, mode=[2])):
                qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(qk_mma, acc_s, frag_q[(None, None, kb, 0)], frag_k[(None, None, kb, read.index)], acc_s)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)

            key0 = kv * TILE_KV
            if key0 + TILE_KV > q_first + shift + 1 or key0 + TILE_KV > len_k:
                self._mask(acc_s, my_row + q_first + shift, key0 + my_col, len_k)
            self._online_softmax(acc_s, acc_o, row_max, row_sum)

            p = cute.make_rmem_tensor(self._c_to_a_layout(acc_s.layout, pv_mma.tv_layout_A.shape[1]), self.dtype)
            cute.make_tensor(p.iterator, acc_s.layout).store(acc_s.load().to(self.dtype))
            cute.nvgpu.warpgroup.fence()
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(pv_mma, acc_o, p, frag_v[(None, None, None, read.index)], acc_o)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            kv_ring.consumer_release(read)
            read.advance()
            if warp == 0 and produce.count < n_kv:
                self._load_kv(kv_ring, produce, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV)
                produce.advance()

        self._store(acc_o, row_sum, mO, head, q_start, q_first + my_row, my_col, len_q)

    @cute.jit
    def _prefetch_descriptors(self, tma_q, tma_k, tma_v):
        """Warp 0 prefetches the three TMA descriptors; returns this thread's (uniform) warp index."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_q)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_k)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_v)
        return warp

    @cute.jit
    def _load_kv(self, ring, state, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV):
        ring.producer_acquire(state)
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_k, tKgK[(None, state.count)], tKsK[(None, state.index)], tma_bar_ptr=bar)
        cute.copy(tma_v, tVgV[(None, state.count)], tVsV[(None, state.index)], tma_bar_ptr=bar)
        ring.producer_commit(state)

    @staticmethod
    def _c_to_a_layout(c, a_values):
        """View an accumulator's register layout as the A operand of the next wgmma (16-bit A):
        each group of 8 accumulator values is one 16-wide k-block of A, in the same order."""
        return cute.make_layout(
            (a_values, c.shape[1], (c.shape[2], cute.size(c, mode=[0]) // cute.size(a_values))),
            stride=(c.stride[0], c.stride[1], (c.stride[2], cute.size(a_values, mode=[2]) * c.stride[0][2])))

    @cute.jit
    def _mask(self, acc_s, limit_row0, col0, len_k):
        """-inf where key > query + shift or key ≥ len_k; acc value 4·j + 2·h + c is
        (row + 8·h, col0 + 8·j + c), limit_row0 = this thread's first row + shift."""
        for j in cutlass.range_constexpr(TILE_KV // 8):
            for h in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(2):
                    key = col0 + 8 * j + c
                    if key > limit_row0 + 8 * h or key >= len_k:
                        acc_s[4 * j + 2 * h + c] = -cutlass.Float32.inf

    @cute.jit
    def _online_softmax(self, acc_s, acc_o, row_max, row_sum):
        """Rescale the running output and sums to the new row max; acc_s becomes P (unnormalised)."""
        correction = cute.make_rmem_tensor((2,), cutlass.Float32)
        self._softmax_step(acc_s, row_max, row_sum, correction)
        self._rescale(acc_o, correction)

    @cute.jit
    def _softmax_step(self, acc_s, row_max, row_sum, correction):
        """New row max and sums; acc_s becomes P (unnormalised); ``correction`` = exp(old max - new
        max), the factor the running output still has to be multiplied by (``_rescale``)."""
        for h in cutlass.range_constexpr(2):
            new_max = row_max[h]
            for j in cutlass.range_constexpr(TILE_KV // 8):
                for c in cutlass.range_constexpr(2):
                    new_max = cute.arch.fmax(new_max, acc_s[4 * j + 2 * h + c])
            new_max = cute.arch.warp_reduction_max(new_max, threads_in_group=4)
            correction[h] = cute.arch.exp2((row_max[h] - new_max) * self.scale_log2)
            row_max[h] = new_max
            offset = new_max * self.scale_log2
            total = row_sum[h] * correction[h]
            for j in cutlass.range_constexpr(TILE_KV // 8):
                for c in cutlass.range_constexpr(2):
                    e = cute.arch.exp2(acc_s[4 * j + 2 * h + c] * self.scale_log2 - offset)
                    acc_s[4 * j + 2 * h + c] = e
                    total += e
            row_sum[h] = total

    @cute.jit
    def _rescale(self, acc_o, correction):
        """Multiply each row of the running output by its ``correction``."""
        for h in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(self.head_dim // 8):
                for c in cutlass.range_constexpr(2):
                    acc_o[4 * j + 2 * h + c] = acc_o[4 * j + 2 * h + c] * correction[h]

    @cute.jit
    def _store(self, acc_o, row_sum, mO, head, q_start, row0, col0, len_q):
        """O / rowsum, bf16, rows inside the sequence only."""
        for h in cutlass.range_constexpr(2):
            inv = 1.0 / cute.arch.warp_reduction_sum(row_sum[h], threads_in_group=4)
            row = row0 + 8 * h
            if row < len_q:
                for j in cutlass.range_constexpr(self.head_dim // 8):
                    for c in cutlass.range_constexpr(2):
                        mO[q_start + row, col0 + 8 * j + c, head] = (acc_o[4 * j + 2 * h + c] * inv).to(self.dtype)
