"""A tensor-parallel rank on the GPU: its Ops (GpuOps and its MoE part with the collectives, on the compute
stream, so a decode graph captures them) and its executor.

Where the collectives go, the dense path's kernels otherwise unchanged (the CPU ranks, cpu_ops.py, do
the same sums in numpy):
  * row-parallel products (o_proj, down_proj: `add_linear`): rank 0 runs the dense op (the residual add
    in its product's epilogue: gemv.cu "res", cuBLAS beta = 1, the CuTe residual epilogue), the other
    ranks the bare product into the residual buffer; one bf16 all-reduce in place makes the new
    residual stream. At batch 1 a layer is 7 kernels: the 5 of one GPU and 2 all-reduces (the next
    GEMV still fuses the RMSNorm in its prologue).
  * where the CuTe plan splits o_proj / down_proj in K (`add_linear_norm`), the float32 partials are
    all-reduced before the one kernel that reduces them, adds the residual and writes the next RMSNorm
    (rms_norm.cu splitk_rms_norm_residual): the all-reduce then the dense path's fused kernel.
  * routed experts (expert parallelism): expert_shard.cu maps the router's ids to the rank's experts
    (others -1, dropped by moe_align.cu); rank 0's combine adds the residual, the others' a zeroed
    buffer; the same all-reduce sums them.
  * weights kept quantized: the shard keeps them quantized (kept_shards.py), and the rank dequantizes its shard
    at start (dequantized_model): the rank ops run bf16 products (serving a shard on the quantized kernels
    needs the rank collectives around GpuQuantOps' linears, not built yet);
  * logits: the rank's vocabulary rows into its slot of a [N, R, V/N] float32 buffer, an all-gather in
    place, then one 2D copy per rank into the sampler's [R, V] logits: every rank holds the whole rows
    and rank 0 samples them with the unchanged sampler (top-k / top-p, logprobs, grammar masks,
    penalties), at the cost of receiving (N-1)/N · R · V · 4 bytes per step (Qwen3-8B, N = 2: 0.3 MB at
    batch 1, 9.7 MB at batch 32).
"""
from __future__ import annotations

import numpy as np

from engine.executor.gpu import GpuExecutor
from engine.executor.gpu_moe_ops import GpuMoEOps
from engine.executor.gpu_ops import GpuOps
from engine.executor.options import ExecutorOptions
from engine.parallel.kept_shards import dequantized_model
from openinfer_kernels.raw_cuda import kernel
from memory.device_arena import Buffer, buffers_nbytes
from memory.state_slots import check_slots


class RankGpuMoEOps(GpuMoEOps):
    """The MoE part of a rank: its (first, number) routed experts (expert parallelism); comm: its
    NcclCommunicator."""

    def __init__(self, plan, shared, arena, comm, experts: tuple[int, int]):
        super().__init__(plan, shared, arena)
        self.comm, self.rank_experts = comm, experts
        self.local_ids = arena.take_all("tp", self.rank_buffers(plan))["tp_expert_ids"]
        self.k_local_ids = kernel("expert_shard", "local_expert_ids")

    @staticmethod
    def rank_buffers(plan) -> list[Buffer]:
        """The rank's view of the router's ids."""
        return [Buffer("tp_expert_ids", (plan.max_tokens * plan.experts.top_k,), np.int32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return super().nbytes(plan) + (buffers_nbytes(cls.rank_buffers(plan)) if plan.experts is not None else 0)

    def experts(self, x, gate_up, down, weights, ids, residual, limit=None):
        T, K = ids.shape
        first, count = self.rank_experts
        sh = self.shared
        local = self.local_ids[:T * K].reshape(T, K)
        sh.launch(self.k_local_ids, (max(1, -(-T * K // 256)),), (256,),
                  (ids, local, np.int32(T * K), np.int32(first), np.int32(count)))
        if self.comm.rank != 0:       # the residual comes from rank 0's combine alone
            residual = sh.residual_out(T, x.shape[1])
            sh.zero(residual)
        return self.comm.all_reduce(super().experts(x, gate_up, down, weights, local, residual, limit))


class RankGpuOps(GpuOps):
    """GpuOps of a rank: the row-parallel sums, the gathered logits and the rank's MoE part. comm: the rank's
    NcclCommunicator; experts: (first, number) of its routed experts."""
    moe_class = RankGpuMoEOps

    def __init__(self, plan, shared, arena, lm_head_ptr: int, comm, experts: tuple[int, int] = (0, 0), **parts):
        self.comm, self.rank_experts = comm, experts
        super().__init__(plan, shared, arena, lm_head_ptr, **parts)
        self.gathered = arena.take_all("tp", self.rank_buffers(plan))["tp_logits"]

    def _moe_part(self, plan, arena) -> RankGpuMoEOps:
        return RankGpuMoEOps(plan, self.shared, arena, self.comm, self.rank_experts)

    @staticmethod
    def rank_buffers(plan) -> list[Buffer]:
        """The gathered logits."""
        return [Buffer("tp_logits", (plan.logit_rows * plan.vocab,), np.float32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return super().nbytes(plan) + buffers_nbytes(cls.rank_buffers(plan))

    def add_linear(self, x, weight, residual, bias=None, lora=None):
        if self.comm.rank == 0:
            out = super().add_linear(x, weight, residual, bias, lora=lora)
        else:                          # the bare partial product (o_proj's bias is zeros here)
            out = self.shared.residual_out(x.shape[0], weight.shape[0])
            self.shared.gemm(x, weight, out, pdl=self.shared.pdl)
        return self.comm.all_reduce(out)

    def reduce_partials(self, partials) -> None:
        splits, rows, cols = partials.shape
        self.comm.all_reduce_raw(partials.ptr, splits * rows * cols, np.float32)

    def logits(self, hidden, weight):
        rows, part, n, rank = hidden.shape[0], weight.shape[0], self.comm.world_size, self.comm.rank
        if rows > self.logits_buf.shape[0]:
            raise ValueError(f"{rows} logit rows exceed the {self.logits_buf.shape[0]} the logits buffer holds")
        gathered = self.gathered[:n * rows * part].reshape(n, rows, part)
        self.shared.gemm(hidden, weight, gathered[rank])              # float32 logits: cuBLAS
        self.comm.all_gather(gathered[rank], gathered)
        import cupy

        out, rt, stream = self.logits_buf[:rows], cupy.cuda.runtime, self.shared.stream
        for r in range(n):             # rank r's logits are columns r·V/N.. of every row
            rt.memcpy2DAsync(out.data.ptr + r * part * 4, out.strides[0], gathered[r].data.ptr, part * 4, part * 4,
                             rows, rt.memcpyDeviceToDevice, stream.ptr)
        return out


class GpuRankExecutor(GpuExecutor):
    """The GPU executor of one rank's shard (sharding.shard_model) on the current device. Rank 0 checks a
    step before any rank sees it (`check`) and names its decode graph (`graph_key`); the others run it
    with `follow`, replaying the graph captured together with rank 0's."""
    ops_class = RankGpuOps
    supports_draft_verify = False   # a verify step's rows sample on rank 0 only (engine/speculative.py check_device)
    supports_eagle3 = False         # a rank keeps its shard of the hidden states, not a head's whole rows

    def __init__(self, model, options: ExecutorOptions, comm, experts: tuple[int, int] = (0, 0)):
        self.comm, self.experts = comm, experts             # the rank's ops take them (_ops)
        super().__init__(dequantized_model(model), options)
        comm.bind(self.stream)

    def _ops(self, shared, lm_head_ptr: int, lora_weights: dict) -> RankGpuOps:
        return RankGpuOps(self.plan, shared, self.arena, lm_head_ptr, self.comm, self.experts,
                          lora_weights=lora_weights, state=self.state)

    def check(self, batch, fed: bool = False) -> None:
        """The step's refusals, here before it goes out: a rank that refused a step the others run would
        leave them waiting inside a collective."""
        self.inputs.check(batch, self.num_kv_blocks, skip_ids=batch.fed_rows() if fed else 0)
        if self.num_state_slots:
            check_slots(batch.state_slots, self.num_state_slots)

    def graph_key(self, batch) -> tuple[int, bool] | None:
        """(bucket, sampling graph) of the decode graph this step replays, or None (eager)."""
        graphs = self.graphs
        if graphs is None or batch.lora_slots is not None or not graphs.serves(batch):
            return None
        return graphs.bucket(len(batch.seqs)), graphs.mode(batch.seqs) == "sampling"

    def submit(self, batch, fed: bool = False):
        if fed:                        # every rank feeds rank 0's sampled ids
            self.comm.broadcast(self.sampler.ids)
        return super().submit(batch, fed)

    def follow(self, batch, fed: bool = False, key: tuple[int, bool] | None = None):
        """Ranks > 0: rank 0's step (follower_batch) on rank 0's graph `key`; the eager path otherwise."""
        if key is None:
            return self.submit(batch, fed)
        if fed:
            self.comm.broadcast(self.sampler.ids)
        b, sampling = key
        self._fed = fed
        self._kv_landed(layerwise=False)          # a host-tier restore still copying lands first
        ctx = self.upload(batch, b)
        if sampling:
            self.sampler.fill_graph_rows(batch.seqs, b)
        self.graphs.run(ctx, b, sampling)
        return self.readback.queue(self.sampler, batch.seqs, True)

    def measure_all_reduce(self, sizes: list[int], iters: int = 50) -> list[dict]:
        """bf16 all-reduces of each size (bytes) back to back on the compute stream, every rank together:
        mean µs each, algorithm and bus bandwidth (nccl-tests' busbw = algbw · 2(N-1)/N)."""
        import cupy

        n, out = self.comm.world_size, []
        for nbytes in sizes:
            x = cupy.zeros(nbytes // 2, cupy.uint16)
            for _ in range(5):
                self.comm.all_reduce(x)
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record(self.stream)
            for _ in range(iters):
                self.comm.all_reduce(x)
            end.record(self.stream)
            end.synchronize()
            us = cupy.cuda.get_elapsed_time(begin, end) * 1e3 / iters
            algbw = nbytes / us / 1e3
            out.append({"bytes": nbytes, "us": us, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n})
        return out

    def close(self) -> None:
        super().close()
        self.comm.close()
