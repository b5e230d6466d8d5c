"""Causal varlen prefill attention, FlashAttention-3 schedule (warp-specialised), Hopper (CuTe DSL).

Computes exactly what ``attention_sm90`` computes (same call, same ``[tokens, heads, D]`` buffers,
same ``(sequence, 128-row query tile)`` work list, cached-prefix alignment, GQA): the two are
interchangeable and the launcher picks one. Head dim D = 128 or 64, softmax scale ``1/sqrt(D)``.

Schedule, per CTA of 384 threads owning 128 query rows of one head:
- warpgroup 0 is the producer: it gives up registers (``setmaxnreg`` 24) and its first warp issues
  TMA loads: Q once (two 64-row halves), then K and V tiles of 128 keys into two separate
  ``kv_stages``-deep mbarrier rings (2 at D = 128, 4 at 64), so ``S = Q·Kᵀ`` can start before V
  has landed;
- warpgroups 1 and 2 are consumers (``setmaxnreg`` 240), 64 query rows each, sharing every K/V
  stage (each stage is released by both). They take turns on the tensor cores through two named
  barriers (ping-pong): a consumer issues ``O += P·V`` for tile j and ``S = Q·Kᵀ`` for tile j+1,
  then hands the turn over and runs its softmax while the other one's wgmmas run;
- online softmax in registers with exp2 (one FFMA per score folds the scale and the running max),
  P converted in registers to the A operand of the register-sourced P·V wgmma; only tiles crossing
  the diagonal or the key end are masked. Key tiles are walked in ascending order, so every row's
  running max is finite from the first tile on (key 0 is always visible) and a tile that is fully
  masked for one consumer's rows (possible with a cached prefix) contributes exactly zero.
- grid ``(Hq, tiles)``: all heads of the longest tile are launched first (work list order), the
  query heads of one KV head run side by side and share its K/V in L2.

Constructor flags, both verified on the H200 and measured slower there (bench/results/kernels.md),
kept as alternatives: ``persistent`` (one CTA per SM striding over the (tile, head) items; Q is
released per item, the K/V rings and the ping-pong turn carry over) and ``overlap`` (within a
consumer, the P·V wgmma of tile j-1 also runs during the softmax of tile j).

Roofline on the H200: ``4 · Σ_causal(len_q · len_k) · D · Hq`` flops at ~790 TFLOP/s dense bf16
wgmma (~3000 flop/clk/SM, i.e. ~6 scores/clk at D = 128); exp2 runs at 16/clk/SM, so the softmax
needs ~37% of the wgmma time at D = 128 (~75% at 64), which the ping-pong hides behind the other
consumer's wgmmas. A K/V tile feeds 128 query rows: 128 flop/B at D = 128, below the ~165 flop/B
HBM balance point, so the kernel relies on L2: the query heads of one KV head run concurrently
(grid order) and read the same K/V tiles.
"""
from __future__ import annotations

from types import SimpleNamespace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from .attention_sm90 import TILE_KV, VarlenAttentionSm90
from .configs import H200_SMS

WG_ROWS = 64            # query rows of one consumer warpgroup
TILE_Q = 2 * WG_ROWS    # query rows of one CTA (one work-list tile)
PRODUCER_REGS, CONSUMER_REGS = 24, 240  # 128·24 + 256·240 ≤ 64 Ki registers
TURN_BARRIER = 1        # named barriers 1 and 2: consumer 0 / 1 may issue its wgmmas
CONSUMER_THREADS = 256


class VarlenAttentionWsSm90(VarlenAttentionSm90):
    """jit entry: ``(q, k, vt, o, cu_q, cu_k, work, stream)``; see the module docstring. Reuses the
    mask, online softmax, register relayout and store of the FlashAttention-2 kernel."""

    def __init__(self, head_dim: int = 128, kv_stages: int = 2, overlap: bool = False, persistent: bool = False):
        super().__init__(head_dim)
        self.kv_stages = kv_stages
        self.overlap = overlap
        self.persistent = persistent

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, vt: cute.Tensor, o: cute.Tensor,
                 cu_q: cute.Tensor, cu_k: cute.Tensor, work: cute.Tensor, stream: cuda.CUstream):
        bf16 = q.element_type
        self.dtype = bf16
        qk_tile = (WG_ROWS, TILE_KV, self.head_dim)
        pv_tile = (WG_ROWS, self.head_dim, TILE_KV)
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), tiler_mn=(WG_ROWS, TILE_KV))
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, utils.LayoutEnum.from_tensor(vt).sm90_mma_major_mode(),
            cutlass.Float32, (1, 1, 1), tiler_mn=(WG_ROWS, self.head_dim), a_source=warpgroup.OperandSource.RMEM)
        # Q: one 64-row stage per consumer warpgroup; K and V: kv_stages-deep rings.
        sq_layout = sm90_utils.make_smem_layout_a(utils.LayoutEnum.from_tensor(q), qk_tile, bf16, 2)
        sk_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.from_tensor(k), qk_tile, bf16, self.kv_stages)
        sv_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.from_tensor(vt), pv_tile, bf16, self.kv_stages)
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tq = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, q, cute.slice_(sq_layout, (None, None, 0)), (WG_ROWS, self.head_dim))
        tma_k, tk = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, k, cute.slice_(sk_layout, (None, None, 0)), (TILE_KV, self.head_dim))
        tma_v, tv = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, vt, cute.slice_(sv_layout, (None, None, 0)), (self.head_dim, TILE_KV))

        @cute.struct
        class Smem:
            q_bar: cute.struct.MemRange[cutlass.Int64, 2]
            k_bar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            v_bar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            sq: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sq_layout)], 1024]
            sk: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sk_layout)], 1024]
            sv: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sv_layout)], 1024]

        self.smem_struct = Smem
        if cutlass.const_expr(self.persistent):  # one CTA per SM, striding over (tile, head) items
            grid = (cutlass.min(cute.size(work, mode=[0]) * cute.size(q, mode=[2]), H200_SMS), 1, 1)
        else:
            grid = (cute.size(q, mode=[2]), cute.size(work, mode=[0]), 1)
        self.kernel(tma_q, tq, tma_k, tk, tma_v, tv, o, cu_q, cu_k, work, qk_mma, pv_mma,
                    sq_layout, sk_layout, sv_layout).launch(
            grid=grid, block=[128 + CONSUMER_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mVt: cute.Tensor, mO: cute.Tensor, cu_q: cute.Tensor,
               cu_k: cute.Tensor, work: cute.Tensor, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
               sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
               sv_layout: cute.ComposedLayout):
        bx, by, _ = cute.arch.block_idx()
        warp = self._prefetch_descriptors(tma_q, tma_k, tma_v)
        tidx, _, _ = cute.arch.thread_idx()
        # Work item w = tile · Hq + head: the grid's (head, tile), or every step-th item from bx.
        first = by * cute.size(mQ, mode=[2]) + bx
        step, count = 1, 1
        if cutlass.const_expr(self.persistent):
            step, _, _ = cute.arch.grid_dim()
            count = (cute.size(work, mode=[0]) * cute.size(mQ, mode=[2]) - bx + step - 1) // step

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32)
        q_ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_bar.data_ptr(), num_stages=1, producer_group=one_thread,
            consumer_group=consumer_warps, tx_count=cute.size_in_bytes(self.dtype, sq_layout),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        k_ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.k_bar.data_ptr(), num_stages=self.kv_stages, producer_group=one_thread,
            consumer_group=consumer_warps,
            tx_count=cute.size_in_bytes(self.dtype, cute.slice_(sk_layout, (None, None, 0))),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        v_ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.v_bar.data_ptr(), num_stages=self.kv_stages, producer_group=one_thread,
            consumer_group=consumer_warps,
            tx_count=cute.size_in_bytes(self.dtype, cute.slice_(sv_layout, (None, None, 0))),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sq.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = storage.sk.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        sV = storage.sv.get_tensor(sv_layout.outer, swizzle=sv_layout.inner)
        smem = SimpleNamespace(sQ=sQ, sK=sK, sV=sV, q_ring=q_ring, k_ring=k_ring, v_ring=v_ring)
        tiles = SimpleNamespace(work=work, cu_q=cu_q, cu_k=cu_k, n_heads=cute.size(mQ, mode=[2]),
                                group=cute.size(mQ, mode=[2]) // cute.size(mK, mode=[2]))
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                tma = SimpleNamespace(q=tma_q, k=tma_k, v=tma_v, mQ=mQ, mK=mK, mVt=mVt)
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
                if cutlass.const_expr(self.persistent):
                    for i in cutlass.range(count, unroll=1):
                        q_state, produce = self._load_tile(first + i * step, q_state, produce, tma, smem, tiles)
                else:
                    self._load_tile(first, q_state, produce, tma, smem, tiles)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(qk_mma, pv_mma, smem, tiles, mO, first, step, count, tidx - 128)

    @cute.jit
    def _tile(self, w, tiles):
        """Work item ``w``: head, sequence starts, first query row, lengths and key tiles."""
        item = w // tiles.n_heads
        head = w - item * tiles.n_heads
        seq = tiles.work[item, 0]
        q_first = tiles.work[item, 1] * TILE_Q  # first query row of this CTA, within the sequence
        q_start, k_start = tiles.cu_q[seq], tiles.cu_k[seq]
        len_q, len_k = tiles.cu_q[seq + 1] - q_start, tiles.cu_k[seq + 1] - k_start
        n_kv = (cutlass.min(q_first + TILE_Q + len_k - len_q, len_k) + TILE_KV - 1) // TILE_KV
        return head, q_start, k_start, q_first, len_q, len_k, n_kv

    @cute.jit
    def _load_tile(self, w, q_state, produce, tma, smem, tiles):
        """Producer, one work item: Q (two 64-row halves) once, then every K and V tile it needs."""
        head, q_start, k_start, q_first, _, _, n_kv = self._tile(w, tiles)
        kv_head = head // tiles.group
        # This sequence's rows of this head, as (64 rows, D) / (128 keys, D) / (D, 128 keys) tiles.
        gQ = cute.local_tile(cute.domain_offset((q_start + q_first, 0), tma.mQ[None, None, head]),
                             (WG_ROWS, self.head_dim), (None, 0))
        gK = cute.local_tile(cute.domain_offset((k_start, 0), tma.mK[None, None, kv_head]),
                             (TILE_KV, self.head_dim), (None, 0))
        gV = cute.local_tile(cute.domain_offset((0, k_start), tma.mVt[None, None, kv_head]),
                             (self.head_dim, TILE_KV), (0, None))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cute.nvgpu.cpasync.tma_partition(
            tma.q, 0, one, cute.group_modes(smem.sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cute.nvgpu.cpasync.tma_partition(
            tma.k, 0, one, cute.group_modes(smem.sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cute.nvgpu.cpasync.tma_partition(
            tma.v, 0, one, cute.group_modes(smem.sV, 0, 2), cute.group_modes(gV, 0, 2))
        smem.q_ring.producer_acquire(q_state)
        for half in cutlass.range_constexpr(2):
            cute.copy(tma.q, tQgQ[(None, half)], tQsQ[(None, half)],
                      tma_bar_ptr=smem.q_ring.producer_get_barrier(q_state))
        q_state.advance()
        for kv in cutlass.range(n_kv, unroll=1):
            smem.k_ring.producer_acquire(produce)
            cute.copy(tma.k, tKgK[(None, kv)], tKsK[(None, produce.index)],
                      tma_bar_ptr=smem.k_ring.producer_get_barrier(produce))
            smem.v_ring.producer_acquire(produce)
            cute.copy(tma.v, tVgV[(None, kv)], tVsV[(None, produce.index)],
                      tma_bar_ptr=smem.v_ring.producer_get_barrier(produce))
            produce.advance()
        return q_state, produce

    @cute.jit
    def _consume(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, smem, tiles, mO: cute.Tensor,
                 first, step, count, ctid):
        """One consumer warpgroup (``ctid`` 0 … 255 over both): its 64 rows of each work item."""
        me = cute.arch.make_warp_uniform(ctid // 128)  # consumer 0 or 1
        tid = ctid % 128
        qk_thr = qk_mma.get_slice(tid)
        pv_thr = pv_mma.get_slice(tid)
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((WG_ROWS, TILE_KV)))
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)  # once, outside the loops: its value must not escape one
        # Per thread: rows lane/4 + 16·warp (+8), columns 2·(lane%4) + 8·j (+1) of its 64-row tile.
        lane = tid % 32
        regs = SimpleNamespace(
            me=me, my_row=(tid // 32) * 16 + lane // 4, my_col=2 * (lane % 4),
            frag_q=qk_mma.make_fragment_A(qk_thr.partition_A(smem.sQ)),
            frag_k=qk_mma.make_fragment_B(qk_thr.partition_B(smem.sK)),
            frag_v=pv_mma.make_fragment_B(pv_thr.partition_B(smem.sV)),
            acc_s=acc_s, acc_o=pv_thr.make_fragment_C(pv_thr.partition_shape_C((WG_ROWS, self.head_dim))),
            p=cute.make_rmem_tensor(self._c_to_a_layout(acc_s.layout, pv_mma.tv_layout_A.shape[1]), self.dtype),
            row_max=cute.make_rmem_tensor((2,), cutlass.Float32),
            row_sum=cute.make_rmem_tensor((2,), cutlass.Float32),
            correction=cute.make_rmem_tensor((2,), cutlass.Float32))
        q_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        if me == 0:  # consumer 0 takes the first turn
            cute.arch.barrier_arrive(barrier_id=TURN_BARRIER, number_of_threads=CONSUMER_THREADS)
        if cutlass.const_expr(self.persistent):
            for i in cutlass.range(count, unroll=1):
                q_read, read = self._consume_tile(first + i * step, q_read, read, qk_mma, pv_mma, regs,
                                                  smem, tiles, mO)
        else:
            self._consume_tile(first, q_read, read, qk_mma, pv_mma, regs, smem, tiles, mO)

    @cute.jit
    def _consume_tile(self, w, q_read, read, qk_mma, pv_mma, regs, smem, tiles, mO):
        """One consumer, one work item: S, softmax and P·V over its key tiles, then the store."""
        head, q_start, _, q_first, len_q, len_k, n_kv = self._tile(w, tiles)
        shift = len_k - len_q  # query i sees keys <= i + shift
        me, acc_s, acc_o, p = regs.me, regs.acc_s, regs.acc_o, regs.p
        row_max, row_sum, correction = regs.row_max, regs.row_sum, regs.correction
        frag_q, frag_k, frag_v = regs.frag_q, regs.frag_k, regs.frag_v
        k_ring, v_ring = smem.k_ring, smem.v_ring
        acc_o.fill(0.0)
        for r in cutlass.range_constexpr(2):
            row_max[r] = -cutlass.Float32.inf
            row_sum[r] = 0.0
        rows_first = q_first + me * WG_ROWS
        limit_row = regs.my_row + rows_first + shift  # this thread's first row sees keys <= limit_row
        mine, other = TURN_BARRIER + me, TURN_BARRIER + 1 - me
        my_col = regs.my_col

        smem.q_ring.consumer_wait(q_read)
        if cutlass.const_expr(not self.overlap):
            cute.arch.barrier(barrier_id=mine, number_of_threads=CONSUMER_THREADS)
            for kv in cutlass.range(n_kv, unroll=1):
                # My turn: S = Q·Kᵀ is issued, then the other consumer may issue its wgmmas.
                k_ring.consumer_wait(read)
                cute.nvgpu.warpgroup.fence()
                self._qk(qk_mma, acc_s, frag_q, frag_k, me, read.index)
                cute.arch.barrier_arrive(barrier_id=other, number_of_threads=CONSUMER_THREADS)
                cute.nvgpu.warpgroup.wait_group(0)
                k_ring.consumer_release(read)
                self._softmax_tile(acc_s, p, row_max, row_sum, correction, kv, rows_first, limit_row,
                                   my_col, shift, len_k)
                self._rescale(acc_o, correction)
                v_ring.consumer_wait(read)
                cute.arch.barrier(barrier_id=mine, number_of_threads=CONSUMER_THREADS)
                cute.nvgpu.warpgroup.fence()
                self._pv(pv_mma, acc_o, p, frag_v, read.index)
                cute.nvgpu.warpgroup.wait_group(0)
                v_ring.consumer_release(read)
                read.advance()
            cute.arch.barrier_arrive(barrier_id=other, number_of_threads=CONSUMER_THREADS)
        else:
            # Also within a warpgroup: P·V of tile j-1 runs while the softmax of tile j does.
            k_ring.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            self._qk(qk_mma, acc_s, frag_q, frag_k, me, read.index)
            cute.nvgpu.warpgroup.wait_group(0)
            k_ring.consumer_release(read)
            self._softmax_tile(acc_s, p, row_max, row_sum, correction, 0, rows_first, limit_row,
                               my_col, shift, len_k)  # acc_o is still 0: no rescale
            for kv in cutlass.range(1, n_kv, unroll=1):
                prev = read.clone()
                read.advance()
                k_ring.consumer_wait(read)
                cute.arch.barrier(barrier_id=mine, number_of_threads=CONSUMER_THREADS)
                cute.nvgpu.warpgroup.fence()
                self._qk(qk_mma, acc_s, frag_q, frag_k, me, read.index)
                v_ring.consumer_wait(prev)
                self._pv(pv_mma, acc_o, p, frag_v, prev.index)
                cute.arch.barrier_arrive(barrier_id=other, number_of_threads=CONSUMER_THREADS)
                cute.nvgpu.warpgroup.wait_group(1)  # S ready; P·V still running
                k_ring.consumer_release(read)
                self._softmax_tile(acc_s, None, row_max, row_sum, correction, kv, rows_first, limit_row,
                                   my_col, shift, len_k)
                cute.nvgpu.warpgroup.wait_group(0)
                v_ring.consumer_release(prev)
                self._rescale(acc_o, correction)
                cute.make_tensor(p.iterator, acc_s.layout).store(acc_s.load().to(self.dtype))
            v_ring.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            self._pv(pv_mma, acc_o, p, frag_v, read.index)
            cute.nvgpu.warpgroup.wait_group(0)
            v_ring.consumer_release(read)
            read.advance()
        smem.q_ring.consumer_release(q_read)  # every S of this item is done: the next Q may load
        q_read.advance()
        self._store(acc_o, row_sum, mO, head, q_start, rows_first + regs.my_row, my_col, len_q)
        return q_read, read

    @cute.jit
    def _qk(self, qk_mma, acc_s, frag_q, frag_k, me, stage):
        """Issue ``S = Q·Kᵀ`` (this consumer's Q half, K stage ``stage``) and commit it."""
        for kb in cutlass.range_constexpr(cute.size(frag_q, mode=[2])):
            qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(qk_mma, acc_s, frag_q[(None, None, kb, me)], frag_k[(None, None, kb, stage)], acc_s)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _pv(self, pv_mma, acc_o, p, frag_v, stage):
        """Issue ``O += P·V`` (V stage ``stage``) and commit it (``pv_mma`` always accumulates)."""
        cute.gemm(pv_mma, acc_o, p, frag_v[(None, None, None, stage)], acc_o)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _softmax_tile(self, acc_s, p, row_max, row_sum, correction, kv, rows_first, limit_row, my_col,
                      shift, len_k):
        """Mask key tile ``kv`` where it crosses the diagonal or the key end, update the row stats
        (``correction`` for the output), and write P to ``p`` as bf16 unless ``p`` is None."""
        key0 = kv * TILE_KV
        if key0 + TILE_KV > rows_first + shift + 1 or key0 + TILE_KV > len_k:
            self._mask(acc_s, limit_row, key0 + my_col, len_k)
        self._softmax_step(acc_s, row_max, row_sum, correction)
        if cutlass.const_expr(p is not None):
            cute.make_tensor(p.iterator, acc_s.layout).store(acc_s.load().to(self.dtype))
