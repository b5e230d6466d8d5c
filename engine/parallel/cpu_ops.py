"""A tensor-parallel rank's Ops in numpy (NumpyOps and its MoE part with the collectives), and the CPU
executor of one rank.

The model line's forward runs unchanged over a rank's shard (engine/parallel/sharding.py); what
differs is where a product covers only part of its sum:
  * row-parallel products (o_proj, down_proj: every `add_linear` of the dense lines) give each rank a
    partial sum; rank 0 adds the residual to its partial (o_proj's bias is rank 0's, zeros elsewhere),
    then one all-reduce makes the new residual stream on every rank (the GPU does the same: rank 0's
    product keeps its residual epilogue);
  * routed experts (expert parallelism): each rank runs its E / N experts over every token (the
    tokens are on every rank already, so dispatch is free), its partial sums go through the same
    all-reduce (the combine);
  * the lm_head holds the rank's vocabulary rows: the logits are gathered (all-gather) into [R, V] on
    every rank, and rank 0 samples from them as a single executor would.
"""
from __future__ import annotations

import numpy as np

from engine.executor.cpu import CpuExecutor
from engine.executor.cpu_moe_ops import NumpyMoEOps
from engine.executor.cpu_ops import NumpyOps
from engine.executor.options import ExecutorOptions
from engine.parallel.comm import Communicator
from memory.kv_format import KVFormat


class RankNumpyMoEOps(NumpyMoEOps):
    """The MoE part of a rank: its (first, number) routed experts over every token, the partial sums
    all-reduced (the combine)."""

    def __init__(self, silu_mul, comm: Communicator, experts: tuple[int, int]):
        super().__init__(silu_mul)
        self.comm, self.rank_experts = comm, experts

    def experts(self, x, gate_up, down, weights, ids, residual, limit=None):
        first, count = self.rank_experts
        local = ids - first
        mine = (local >= 0) & (local < count)
        # another rank's assignment weighs 0 on expert 0: its rows add exactly 0
        base = residual if self.comm.rank == 0 else np.zeros_like(residual)
        y = super().experts(x, gate_up, down, np.where(mine, weights, np.float32(0)), np.where(mine, local, 0),
                            base, limit)
        return self.comm.all_reduce(y)


class RankNumpyOps(NumpyOps):
    """NumpyOps of a rank: the row-parallel sums, vocab-parallel logits and the rank's MoE part. comm: the
    rank's communicator; experts: (first, number) of its routed experts."""

    def __init__(self, kv, families, state, lora, comm: Communicator, experts: tuple[int, int] = (0, 0),
                 kv_format: KVFormat = KVFormat()):
        self.comm, self.rank_experts = comm, experts
        super().__init__(kv, families, state, lora, kv_format)

    def _moe_part(self) -> RankNumpyMoEOps:
        return RankNumpyMoEOps(self.silu_mul, self.comm, self.rank_experts)

    def add_linear(self, x, weight, residual, bias=None, lora=None):
        y = self.linear(x, weight, bias)
        return self.comm.all_reduce(y + residual if self.comm.rank == 0 else y)

    def logits(self, hidden, weight):
        return np.concatenate(list(self.comm.all_gather(self.linear(hidden, weight))), axis=-1)


class CpuRankExecutor(CpuExecutor):
    """The numpy executor of one rank's shard (engine/parallel/sharding.py shard_model): its KV pool
    holds the rank's KV heads. `follow` runs a step rank 0 submitted (the same code: the same
    collectives in the same order)."""
    supports_eagle3 = False        # a rank keeps its shard of the hidden states, not a head's whole rows
    supports_mtp = False           # nor the whole last hidden state an MTP layer reads

    def __init__(self, model, options: ExecutorOptions, comm: Communicator, experts: tuple[int, int] = (0, 0)):
        self.comm, self.experts = comm, experts          # the rank's ops take them (_ops)
        super().__init__(model, options)

    def _ops(self, state, lora) -> RankNumpyOps:
        return RankNumpyOps(self.kv, self.model.op_families, self._state_arrays(state), lora, self.comm, self.experts,
                            self.kv_format)

    def graph_key(self, batch):
        """No CUDA graphs on the CPU."""
        return None

    def check(self, batch, fed: bool = False) -> None:
        """Nothing to check before the ranks start: a step every rank refuses raises on each before any
        collective, and the thread group recovers (ranks.ThreadRanks)."""

    def follow(self, batch, fed: bool = False, key=None):
        return self.submit(batch, fed)
