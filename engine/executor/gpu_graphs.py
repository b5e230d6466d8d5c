"""CUDA-graph decode: one graph per batch-size bucket, captured on first use and replayed after.

A graph holds the whole decode step from the static input buffer to the greedy pick: the model
forward (its kernels launched as programmatic dependent launches unless the executor's pdl_decode
is off), the gather of the sampled rows, the lm_head and argmax_logprob into the sampler's id
buffer. Batches are padded up to their bucket (padded rows: position and slot -1, so they write
no KV and attend to nothing). Steps whose requests all decode greedily without logit processing
or logprobs queue the ids' copy into pinned host memory behind the graph and return at once
(`launch` -> GraphStep): the caller's host work overlaps the step until GraphStep.result() waits
on the copy's event (the one sync of the step). Any other step runs the GPU sampler eagerly on the
graph's logits. Prefill and mixed steps stay eager.
"""
from __future__ import annotations

import bisect
import contextlib
import time

import numpy as np

from engine.batch import ModelBatch, SampledToken, StepOutput
from engine.executor.base import DoneStep, PendingStep
from engine.executor.gpu_sampler import needs_processing

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range (nsys timelines read as the model); a no-op where NVTX is unavailable."""
    try:
        from cupy.cuda import nvtx
        nvtx.RangePush(name)
    except Exception:
        yield
        return
    try:
        yield
    finally:
        nvtx.RangePop()


class GraphStep:
    """A replayed decode graph whose greedy ids are on their way into pinned host memory."""

    def __init__(self, seq_ids: list[int], ids_host: np.ndarray, done):
        self.seq_ids, self.ids_host, self.done = seq_ids, ids_host, done

    def result(self) -> StepOutput:
        self.done.synchronize()
        return StepOutput(sampled=[SampledToken(s, t) for s, t in zip(self.seq_ids, self.ids_host.tolist())])


class DecodeGraphs:
    def __init__(self, executor):
        from memory.streams import pinned_array

        self.ex = executor
        self.buckets = [b for b in BUCKETS if b <= executor.max_seqs] or [executor.max_seqs]
        self.graphs: dict[int, tuple] = {}
        self.last_host_s = 0.0
        self.ids_host = pinned_array((executor.max_seqs,), np.int32)   # one step in flight at a time
        import cupy
        self.ids_ready = cupy.cuda.Event(block=False, disable_timing=True)   # recorded after the ids' copy

    def serves(self, batch: ModelBatch) -> bool:
        return (batch.is_decode_only and len(batch.seqs) <= self.buckets[-1]
                and all(s.sample and not s.want_prompt_logprobs for s in batch.seqs))

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def _body(self, ctx):
        ex = self.ex
        ex.ops.reset()
        ex.ops.pdl = ex.pdl_decode
        try:
            hidden = ex.model.forward(ex.ops, ex.weights, ctx)
            rows = ex.ops.gather_rows(hidden, ctx.sample_rows)
            logits = ex.model.compute_logits(ex.ops, ex.weights, rows)
        finally:
            ex.ops.pdl = False
        s, null = ex.sampler, np.uint64(0)
        s.k_argmax((ctx.num_tokens,), (1024,), (logits, np.int32(ex.vocab_size), null, s.ids, null, s.lse),
                   stream=ex.stream)
        return logits

    def _capture(self, ctx) -> tuple:
        import cupy

        ex = self.ex
        logits = self._body(ctx)          # eager warm-up: kernels loaded, cuBLAS heuristics run; also this step
        ex.stream.synchronize()
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        ex.stream.begin_capture(*(() if mode is None else (mode,)))
        try:
            self._body(ctx)
        finally:
            graph = ex.stream.end_capture()
        return graph, logits

    def launch(self, batch: ModelBatch, t0: float) -> PendingStep:
        import cupy

        ex, seqs = self.ex, batch.seqs
        b = self.bucket(len(seqs))
        ctx = ex._context(batch, pad_to=b)
        if b not in self.graphs:
            self.graphs[b] = self._capture(ctx)
        else:
            self.graphs[b][0].launch(stream=ex.stream)
        logits = self.graphs[b][1]
        if all(s.params.greedy and s.params.logprobs is None and not needs_processing(s) for s in seqs):
            n = len(seqs)
            cupy.cuda.runtime.memcpyAsync(self.ids_host.ctypes.data, ex.sampler.ids.data.ptr, n * 4,
                                          cupy.cuda.runtime.memcpyDeviceToHost, ex.stream.ptr)
            self.ids_ready.record(ex.stream)
            self.last_host_s = time.perf_counter() - t0
            return GraphStep([s.seq_id for s in seqs], self.ids_host[:n], self.ids_ready)
        self.last_host_s = time.perf_counter() - t0
        return DoneStep(StepOutput(sampled=ex.sampler.sample(logits[:len(seqs)], seqs)))
