"""CUDA-graph decode: graphs per batch-size bucket, captured on first use and replayed after.

A graph holds the whole decode step from the static input buffer to the sampled ids: the model
forward (its kernels launched as programmatic dependent launches unless `pdl` is off), the gather of the sampled rows, the lm_head and the argmax (ids and logsumexp) into the
sampler's buffers. Batches are padded up to their bucket (padded rows: position and slot -1, so they
write no KV and attend to nothing). Each bucket has up to two graphs:
  * greedy: ends at the argmax; serves steps whose rows all decode greedily without logprobs;
  * sampling: the argmax, then the sampler's kernels over every row of the bucket (gpu_sampler
    `graph_tail`: sample_filtered for temperature / top_k / top_p / min_p with the host's seeded
    uniform, the chosen token's logprob, per-row top logprobs), reading per-row parameters from a
    static device block the host fills before each replay (greedy and padded rows have temperature 0
    and no logprobs, so they keep their argmax and write nothing else); serves every other step
    whose rows need no logit processing — the same kernels as the eager sampler, so the same ids
    and logprobs.
Both queue the results' copy into pinned host memory behind the graph and return at once (`launch`
-> gpu_readback.ReadbackStep): the caller's host work overlaps the step until its result() waits on
the copy's event (the one sync of the step). Steps with logit_bias / min_tokens / penalties
(gpu_sampler `needs_processing`) replay the greedy graph and run the GPU sampler eagerly on its
logits. Steps with grammar rows
(structured output) replay the greedy graph too: while it runs, the host computes the rows' token
masks, then the sampler queues the masked tail behind it (gpu_sampler `masked_tail`), read back like
a graphed step. Prefill and mixed steps
run eagerly (GpuExecutor), returned the same way where their rows need no logit processing.
"""
from __future__ import annotations

import bisect
import contextlib
import time


from engine.batch import ModelBatch, StepOutput
from engine.executor.base import DoneStep, PendingStep
from engine.executor.gpu_readback import Readback
from engine.executor.gpu_sampler import needs_processing



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


def capture_mode() -> tuple:
    """Relaxed stream capture (other threads may use CUDA meanwhile), where CuPy names it: the arguments
    of Stream.begin_capture."""
    try:
        import cupy
    except ImportError:
        return ()
    mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
    return () if mode is None else (mode,)


@contextlib.contextmanager
def capture_memory(shared):
    """CuPy allocations inside come from shared.capture_pool, a memory pool only captures and their eager warm-up
    steps use (made on first use): a line whose ops allocate temporaries (DeepSeek-V4's float32 arrays) gets
    addresses that no eager step or later allocation is handed while a graph holds them, and the warm-up leaves
    the blocks the capture takes in the pool (no cudaMalloc while capturing). The graphs share it: they replay one
    at a time on one stream and their temporaries die within a replay; what the ops keep (converted weights, the
    hyper-connections' counters, allocated once at their largest) stays allocated, never handed out again. Lines
    whose ops allocate nothing (graph_temporaries False) capture without it."""
    try:
        import cupy
    except ImportError:
        yield
        return
    if shared.capture_pool is None:
        shared.capture_pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(shared.capture_pool.malloc):
        yield


class DecodeGraphs:
    """The executor's parts a decode graph drives: the model line's forward over `ops` and `weights`,
    the `sampler`'s argmax / sampling tail, `upload(batch, pad_to)`, which checks a step and puts
    its inputs into the static buffers (StepInputs) the graph reads, and the `readback` its results
    come home by; `sizes`: the captured buckets."""

    def __init__(self, model, ops, weights, sampler, upload, readback: Readback, stream, sizes: tuple[int, ...],
                 pdl: bool = True):
        self.model, self.ops, self.weights, self.sampler = model, ops, weights, sampler
        self.upload, self.readback, self.stream, self.pdl = upload, readback, stream, pdl
        self.buckets = sorted(sizes)
        self.graphs: dict[int, tuple] = {}             # greedy graphs: bucket -> (graph, logits)
        self.sampling_graphs: dict[int, tuple] = {}    # sampling graphs: bucket -> (graph, logits)
        self.last_host_s = 0.0

    def serves(self, batch: ModelBatch) -> bool:
        return (batch.is_decode_only and len(batch.seqs) <= self.buckets[-1]
                and all(s.sample and not s.want_prompt_logprobs for s in batch.seqs))

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def _body(self, ctx, sampling: bool):
        ops = self.ops
        ops.reset()
        with ops.shared.pdl_launches(self.pdl):
            hidden = self.model.forward(ops, self.weights, ctx)
            rows = ops.gather_rows(hidden, ctx.sample_rows)
            logits = self.model.compute_logits(ops, self.weights, rows)
        if sampling:
            self.sampler.graph_tail(logits, ctx.num_tokens)
        else:
            self.sampler.argmax(logits, ctx.num_tokens)
        return logits

    def _capture(self, ctx, sampling: bool) -> tuple:
        pool = capture_memory(self.ops.shared) if self.model.graph_temporaries else contextlib.nullcontext()
        with pool:
            logits = self._body(ctx, sampling)    # eager warm-up: kernels loaded, cuBLAS heuristics run, the pool
            self.stream.synchronize()             # primed (the capture then allocates nothing new); also this step
            self.stream.begin_capture(*capture_mode())
            try:
                self._body(ctx, sampling)
            finally:
                graph = self.stream.end_capture()
        return graph, logits

    def missing(self) -> list[tuple[int, bool]]:
        """(bucket, sampling) graphs not captured yet, smallest bucket first."""
        return [(b, sampling) for b in self.buckets for sampling in (False, True)
                if b not in (self.sampling_graphs if sampling else self.graphs)]

    def rows_of(self, bucket: int) -> int:
        """Token rows of a bucket's graph: one a sequence (a verify graph's: 1 + k, gpu_verify_graphs.py)."""
        return bucket

    def warm(self, b: int, sampling: bool, ctx) -> None:
        """Capture bucket b's graph now, on a context of padded rows (executor.warm_up)."""
        graphs = self.sampling_graphs if sampling else self.graphs
        if b not in graphs:
            if sampling:
                self.sampler.fill_graph_rows([], self.rows_of(b))
            graphs[b] = self._capture(ctx, sampling)

    def _replay(self, graphs: dict, ctx, b: int, sampling: bool):
        if b not in graphs:
            graphs[b] = self._capture(ctx, sampling)
        else:
            graphs[b][0].launch(stream=self.stream)
        return graphs[b][1]

    def mode(self, seqs) -> str:
        """How launch() runs these rows: "greedy" / "sampling" (that graph), or the greedy graph followed by
        the masked tail ("masked": grammar rows) or by the eager sampler ("eager": logit processing).
        Tensor-parallel ranks replay the graph rank 0's mode picks (engine/parallel)."""
        if any(map(needs_processing, seqs)):
            return "eager"
        if any(s.grammar is not None for s in seqs):
            return "masked"
        if all(s.params.greedy and s.params.logprobs is None for s in seqs):
            return "greedy"
        return "sampling"

    def run(self, ctx, b: int, sampling: bool):
        """Replay bucket b's greedy or sampling graph on the uploaded ctx (captured here on first use);
        returns its logits."""
        return self._replay(self.sampling_graphs if sampling else self.graphs, ctx, b, sampling)

    def launch(self, batch: ModelBatch, t0: float) -> PendingStep:
        seqs = batch.seqs
        n, b = len(seqs), self.bucket(len(seqs))
        mode = self.mode(seqs)
        ctx = self.upload(batch, b)
        if mode == "sampling":
            self.sampler.fill_graph_rows(seqs, b)
        logits = self.run(ctx, b, mode == "sampling")
        if mode == "masked":
            self.sampler.masked_tail(logits, seqs)
        elif mode == "eager":
            self.last_host_s = time.perf_counter() - t0
            return DoneStep(StepOutput(sampled=self.sampler.sample(logits[:n], seqs)))
        pending = self.readback.queue(self.sampler, seqs, mode == "greedy")
        self.last_host_s = time.perf_counter() - t0
        return pending
