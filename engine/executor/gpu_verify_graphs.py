"""Verify steps (speculative decoding, gpu_verify.py) as CUDA graphs, one pair (greedy, sampling) per bucket of
sequences, as the decode graphs (gpu_graphs.py) are for decode steps.

k is fixed per engine (options.num_speculative_tokens), so a verify graph's shape is static: `bucket` sequences of
k + 1 token rows each. A sequence with fewer drafts (or none: a plain decode in a verify step) pads its rows with
position and slot -1, which write no KV and attend to nothing, and compare -1, so acceptance stops before them
(verify_rows.pad_verify_batch / pad_rows). The graph is the decode graph's body over those rows: the forward, the
lm_head over every row, the argmax or the sampling tail (fill_graph_rows' per-row parameters, each row's step
after the drafts before it); the acceptance and the read-back follow it (GpuVerify.queue), grammar rows take the
masked tail and rows with logit processing the eager sampler, as in decode graphs.

Attention in the graph is paged_decode.cu per row (the rows' positions make it causal within the k + 1 rows,
their keys written by qkv_rope_cache first): the chunk kernel (paged_chunk.cu, which stages each key tile once
for a sequence's k + 1 rows × its GQA heads) plans its tiles and splits per step on the host, so it serves the
eager verify steps. Per-row walks read a sequence's keys k + 1 times, mostly from L2 at small batches, where
launch overhead is what a graph saves; from VERIFY_GRAPH_MAX_SEQS sequences on steps run eager (piecewise graphs
around the chunk kernel on the dense lines). Dense lines only (model.piecewise_graphs: the lines whose
multi-token steps capture; MoE and MLA lines plan those on the host).
"""
from __future__ import annotations

import time

from engine.batch import ModelBatch, StepOutput
from engine.executor.base import DoneStep, PendingStep
from engine.executor.gpu_graphs import DecodeGraphs
from engine.executor.verify_rows import pad_rows, pad_verify_batch, verify_rows

VERIFY_GRAPH_MAX_SEQS = 8       # sequences: above, the chunk kernel's single key pass beats per-row walks (a guess
                                # to measure: bench/speculative.py reports the verify step graphed and eager)


def verify_buckets(sizes: tuple[int, ...], per_seq: int, max_tokens: int) -> list[int]:
    """The graph sizes a verify graph takes: at most VERIFY_GRAPH_MAX_SEQS sequences, per_seq rows each within a
    step's tokens."""
    return [b for b in sizes if b <= VERIFY_GRAPH_MAX_SEQS and b * per_seq <= max_tokens]


class VerifyGraphs(DecodeGraphs):
    """DecodeGraphs over verify steps: `upload` takes a padded ModelBatch (pad_verify_batch) and returns its
    static context; `verify` is the executor's GpuVerify; per_seq: 1 + num_speculative_tokens."""

    def __init__(self, model, ops, weights, sampler, upload, readback, stream, buckets: list[int], verify,
                 per_seq: int, pdl: bool = True):
        super().__init__(model, ops, weights, sampler, upload, readback, stream, tuple(buckets), pdl)
        self.verify, self.per_seq = verify, per_seq

    def serves(self, batch: ModelBatch) -> bool:
        return (bool(self.buckets) and len(batch.seqs) <= self.buckets[-1] and batch.lora_slots is None
                and not batch.block_copies.size and any(s.num_drafts for s in batch.seqs)
                and all(s.sample and not s.want_prompt_logprobs and len(s.token_ids) == 1 + s.num_drafts
                        and s.num_drafts < self.per_seq for s in batch.seqs))

    def rows_of(self, bucket: int) -> int:
        return bucket * self.per_seq

    def launch(self, batch: ModelBatch, t0: float) -> PendingStep:
        b = self.bucket(len(batch.seqs))
        self.verify.check(b, self.rows_of(b))
        ctx = self.upload(pad_verify_batch(batch, self.per_seq, b))
        rows = pad_rows(verify_rows(batch.seqs), self.per_seq, b)     # the grammars' masks while the upload goes
        mode = self.mode(rows.steps)
        if mode == "sampling":
            self.sampler.fill_graph_rows(rows.steps, rows.num_rows)
        logits = self.run(ctx, b, mode == "sampling")
        if mode == "eager":
            tokens = self.sampler.sample(logits[:rows.num_rows], rows.steps, rows.bitmask)
            self.last_host_s = time.perf_counter() - t0
            return DoneStep(StepOutput(sampled=rows.accept(tokens)))
        if mode == "masked":
            self.sampler.masked_tail(logits, rows.steps, rows.bitmask)
        pending = self.verify.queue(rows, mode == "greedy", self.readback)
        self.last_host_s = time.perf_counter() - t0
        return pending


def build_verify_graphs(ex) -> VerifyGraphs | None:
    """A GpuExecutor's verify graphs; None where speculation or graphs are off, the line's multi-token steps do
    not capture (model.piecewise_graphs), or no bucket fits a step's tokens."""
    k = ex.options.num_speculative_tokens
    if not k or ex.graphs is None or not ex.model.piecewise_graphs or ex.options.tensor_parallel_size > 1:
        return None
    buckets = verify_buckets(ex.options.graph_sizes, k + 1, ex.plan.max_tokens)
    if not buckets:
        return None

    def upload(padded: ModelBatch):
        """pad_verify_batch's step checked and uploaded, its splits the graph's (max_model_len's)."""
        ex.inputs.check(padded, ex.num_kv_blocks)
        ctx = ex.inputs.upload(padded, lambda T, _: ex.ops.splits(T, ex.plan.kv.heads, ex.max_model_len))
        if ex.ops.lora is not None:
            ex.ops.lora.use(None, ctx.num_tokens)
        return ctx

    return VerifyGraphs(ex.model, ex.ops, ex.weights, ex.sampler, upload, ex.readback, ex.stream, buckets,
                        ex.verify, k + 1, pdl=ex.options.gpu.pdl)
