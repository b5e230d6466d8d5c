"""TensorParallelExecutor: rank 0's executor, the one the engine loop drives. The scheduler runs once,
on rank 0: each call (a step, the host tier's copies, a graph warm-up) goes to every other rank first
(ranks.py), then runs on rank 0's own shard. Every rank runs the same executor code on the same step, so
they issue the same collectives in the same order; only rank 0's sampled tokens are used.

The other ranks get the step as `follower_batch`: the ModelBatch's arrays (what the kernels read) with
each sequence cut down to what decides the code path (sample, prompt-logprob rows), greedy, with no
grammar or history; a GPU decode step also carries rank 0's graph choice (bucket, greedy / sampling
graph), since a captured collective must be replayed from the graphs captured together on every rank.
A fed decode step (async scheduling) first broadcasts rank 0's sampled ids, so every rank feeds the
same tokens. The KV pool the scheduler sees is the smallest of the ranks' pools.
"""
from __future__ import annotations

import dataclasses

from engine.batch import ModelBatch, SeqStep
from engine.executor.base import ExecutorBase, PendingStep
from engine.request import SamplingParams

FOLLOWER_PARAMS = SamplingParams(temperature=0.0)


def follower_step(s: SeqStep) -> SeqStep:
    """A sequence's step as the other ranks run it: its flags and, for prompt logprobs, the tokens that
    decide how many rows get logits (prompt_logprob_targets); greedy, no grammar."""
    history = s.history[:s.context_len + 1] if s.want_prompt_logprobs else []
    return SeqStep(seq_id=s.seq_id, token_ids=s.token_ids, start_pos=s.start_pos, block_table=[], sample=s.sample,
                   params=FOLLOWER_PARAMS, prompt_len=s.prompt_len, history=history,
                   want_prompt_logprobs=s.want_prompt_logprobs, lora_id=s.lora_id, state_slot=s.state_slot,
                   num_drafts=s.num_drafts)


def follower_batch(batch: ModelBatch) -> ModelBatch:
    return dataclasses.replace(batch, seqs=[follower_step(s) for s in batch.seqs])


class TensorParallelExecutor(ExecutorBase):
    """local: rank 0's executor (CpuRankExecutor / GpuRankExecutor); followers: the other ranks
    (ranks.ThreadRanks / ranks.ProcessRanks)."""

    def __init__(self, local, followers):
        self.local, self.followers = local, followers
        self.options, self.vocab_size = local.options, local.vocab_size
        self.world_size = local.comm.world_size
        self.num_kv_blocks = min([local.num_kv_blocks] + list(followers.num_kv_blocks))
        self.supports_host_tier = local.supports_host_tier
        self.supports_block_copies = local.supports_block_copies
        self.kv_block_bytes = local.kv_block_bytes              # this rank's share (KV heads split)
        self.supports_fed_steps = local.supports_fed_steps
        self.num_state_slots = local.num_state_slots
        self.step_cost = local.step_cost                        # rank 0's (every rank holds a like share)
        self.supports_draft_verify = local.supports_draft_verify
        self.rolls_back_state = local.rolls_back_state

    @property
    def last_step_graphed(self) -> bool:
        return self.local.last_step_graphed

    @property
    def last_host_s(self) -> float:
        return self.local.last_host_s

    def rank0(self):
        """Rank 0's own executor (the start-up line names it and its library)."""
        return self.local

    def _run(self, name: str, args: tuple, here):
        """`name`(*args) on every other rank, then here() on rank 0."""
        self.followers.send((name, args))
        try:
            out = here()
        except BaseException as e:
            self.followers.settle(e)
            raise
        self.followers.settle(None)
        return out

    def submit(self, batch: ModelBatch, fed: bool = False) -> PendingStep:
        self.local.check(batch, fed)
        key = self.local.graph_key(batch)
        return self._run("follow", (follower_batch(batch), fed, key), lambda: self.local.submit(batch, fed))

    def execute(self, batch: ModelBatch):
        return self.submit(batch).result()

    def forward_logits(self, batch: ModelBatch):
        self.local.check(batch)
        return self._run("forward_logits", (follower_batch(batch),), lambda: self.local.forward_logits(batch))

    def copy_blocks(self, offloads, restores) -> None:
        self._run("copy_blocks", (offloads, restores), lambda: self.local.copy_blocks(offloads, restores))

    def warm_up(self) -> bool:
        return self._run("warm_up", (), self.local.warm_up)

    def call(self, name: str, *args):
        """Any rank-executor method run on every rank together (benchmarks: measure_all_reduce)."""
        return self._run(name, args, lambda: getattr(self.local, name)(*args))     # the caller names the method

    def last_gpu_ms(self) -> float | None:
        return self.local.last_gpu_ms()

    def discard_step_times(self) -> None:
        self.local.discard_step_times()

    def set_lora(self, slot: int, adapter) -> None:
        raise RuntimeError("LoRA adapters are not sharded across tensor-parallel ranks")

    def close(self) -> None:
        try:
            self.followers.close()
        finally:
            self.local.close()
