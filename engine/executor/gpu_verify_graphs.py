"""Verify steps (speculative decoding, gpu_verify.py) as CUDA graphs, one pair (greedy, sampling) per bucket of
sequences, as the decode graphs (gpu_graphs.py) are for decode steps.

k is fixed per engine (options.num_speculative_tokens), so a verify graph's shape is static: `bucket` sequences of
k + 1 token rows each. A sequence with fewer drafts (or none: a plain decode in a verify step) pads its rows with
position and slot -1, which write no KV and attend to nothing, and compare -1, so acceptance stops before them
(verify_rows.pad_verify_batch / pad_rows). The graph is the decode graph's body over those rows: the forward, the
lm_head over every row, the argmax or the sampling tail (fill_graph_rows' per-row parameters, each row's step
after the drafts before it); the acceptance and the read-back follow it (GpuVerify.queue), grammar rows take the
masked tail and rows with logit processing the eager sampler, as in decode graphs.

Attention in the graph is paged_chunk.cu (gpu_chunk.py: each key tile staged once for a sequence's k + 1 rows ×
its GQA heads, on tensor cores), as in eager verify steps, over static tiles (sequence i's rows; the bucket's tiles
a prefix of the largest bucket's, uploaded once): the kernel reads each tile's context from the rows' positions on
the device, so only its split count is fixed, max_model_len's, as the decode graphs' is; padded rows (position -1)
attend to nothing. Layers of another shape, and lines without the chunk kernel, take paged_decode.cu per row (the
rows' positions make it causal within the k + 1 rows, their keys written by qkv_rope_cache first). Dense lines only
(model.piecewise_graphs: the lines whose multi-token steps capture; MoE and MLA lines plan those on the host).
Steps of more than VERIFY_GRAPH_MAX_SEQS sequences run eager (piecewise graphs around the same chunk attention).
"""
from __future__ import annotations

import time

import numpy as np

from engine.batch import ModelBatch, StepOutput
from engine.executor.base import DoneStep, PendingStep
from engine.executor.gpu_chunk import chunk_tiles
from engine.executor.gpu_graphs import DecodeGraphs
from engine.executor.verify_rows import pad_rows, pad_verify_batch, verify_rows

VERIFY_GRAPH_MAX_SEQS = 32      # the largest verify graph (bench/speculative.py times the verify step graphed and
                                # eager at batch 1, 8 and 32)


def verify_buckets(sizes: tuple[int, ...], per_seq: int, max_tokens: int) -> list[int]:
    """The graph sizes a verify graph takes: at most VERIFY_GRAPH_MAX_SEQS sequences, per_seq rows each within a
    step's tokens."""
    return [b for b in sizes if b <= VERIFY_GRAPH_MAX_SEQS and b * per_seq <= max_tokens]


class VerifyGraphs(DecodeGraphs):
    """DecodeGraphs over verify steps: `upload` takes a padded ModelBatch (pad_verify_batch) and returns its
    static context; `verify` is the executor's GpuVerify; per_seq: 1 + num_speculative_tokens; chunk: the
    executor's ChunkKernel (None: paged_decode.cu serves), its tiles in verify.tiles."""

    def __init__(self, model, ops, weights, sampler, upload, readback, stream, buckets: list[int], verify,
                 per_seq: int, max_model_len: int, chunk=None, pdl: bool = True):
        super().__init__(model, ops, weights, sampler, upload, readback, stream, tuple(buckets), pdl)
        self.verify, self.per_seq, self.max_model_len, self.chunk = verify, per_seq, max_model_len, chunk
        if chunk is not None:
            b = self.buckets[-1]
            tiles = chunk_tiles(np.arange(b + 1, dtype=np.int32) * per_seq, np.ones(b, bool), chunk.tokens)
            self.tiles_per_seq = tiles.shape[0] // b
            verify.tiles[:tiles.size].set(tiles.ravel(), stream=stream)

    def _body(self, ctx, sampling: bool):
        if self.chunk is None:
            return super()._body(ctx, sampling)
        with self.ops.hooked_attention(self._chunk_attention):
            return super()._body(ctx, sampling)

    def _chunk_attention(self, q, spec, ctx):
        """o[T, Hq·D]: paged_chunk.cu over the bucket's tiles, its split count max_model_len's (layers of another
        shape: paged_decode.cu per row)."""
        ops, chunk = self.ops, self.chunk
        out = ops.activation(ctx.num_tokens, spec.num_heads * spec.head_dim)
        if spec.head_dim != chunk.head_dim or spec.num_heads != chunk.group * spec.num_kv_heads:
            ops.paged_attention(q, spec, ctx, out)
            return out
        n = ctx.block_tables.shape[0] * self.tiles_per_seq
        chunk.launch(ops, q, spec, ctx, out, self.verify.tiles[:2 * n], n, self.max_model_len)
        return out

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

    chunk = ex.prefill.chunk if ex.prefill is not None else None
    return VerifyGraphs(ex.model, ex.ops, ex.weights, ex.sampler, upload, ex.readback, ex.stream, buckets,
                        ex.verify, k + 1, ex.max_model_len, chunk, pdl=ex.options.gpu.pdl)
