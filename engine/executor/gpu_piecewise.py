"""Piecewise CUDA graphs for eager (prefill and mixed) steps, by token bucket; attention between them.

An eager step launches ~9 kernels per layer from Python (~330 for Qwen3-4B): a 1024-token prefill spends
~16 ms launching for ~13 ms of GPU work. Everything between two attention calls of a dense line's
forward (embed, norms, products, rope + KV write, SiLU·up, residual adds) depends only on the step's
token count and on buffers at fixed addresses (the static step inputs, the activation ring, the
residual), so it is captured once per token bucket as a CUDA graph: a step of T tokens is padded to its
bucket (padded rows: position and slot -1, so they write no KV; row-wise ops keep whatever they hold
apart from the real rows) and replays layer-by-layer segments, with the attention of each layer launched
eagerly in between (its plan, the CuTe prefill launches and the paged rows, changes every step), writing
into the output rows the next segment reads: 37 graph launches and the attention's own launches instead
of ~330 kernels (vLLM's piecewise graphs, in the same spirit).

Capture (per bucket, on first use or while the engine is idle): one eager pass on padded rows (kernels
loaded, cuBLAS heuristics run, attention skipped), then the same pass under stream capture, a graph
ended and a new one begun at each attention call; the hole records the call's query, spec and output
buffer (GpuOps.hooked_attention: the ops' public hook for it). The activation ring is reset before both
passes so they hand out the same addresses, and left where the capture left it after a replay, so the ops after the forward (sampling rows, lm_head) do not
reuse the hidden states' slot. A model line opts in with `piecewise_graphs` (the dense lines; Qwen3-MoE's
ops are capturable too, a padded row's routing dropping its slots where its logits are NaN, but it stays
off: qwen3_moe.py says why; lines whose ops decide from the data on the host, MLA's expanded or absorbed
prefill, do not); LoRA steps stay eager.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.batch import ModelBatch
from engine.executor.gpu_graphs import capture_mode


def eager_buckets(max_tokens: int, limit: int) -> list[int]:
    """Token buckets up to min(limit, max_tokens): 16, 32, 64, then every 128 (padding ≤ 1/8 from 128
    tokens on); none when limit is 0."""
    top = min(limit, max_tokens)
    if top <= 0:
        return []
    sizes = [b for b in (16, 32, 64) if b < top] + list(range(128, top + 1, 128))
    return sorted(set(sizes + [top]))


@dataclass
class Hole:
    """One attention call between two segments: its query, spec and the output rows the next segment reads."""
    q: object
    spec: object
    out: object


@dataclass
class BucketGraphs:
    segments: list            # CUDA graphs, len(holes) + 1
    holes: list[Hole]
    hidden: object            # the forward's output (fixed address)
    ring_after: int           # the activation ring's position after the forward


class PiecewiseGraphs:
    """The executor's eager-step graphs: `serves(batch)`, `bucket(T)`, `forward(ctx)` on a context padded
    to its bucket (StepInputs.upload pad_tokens), `missing()` / `warm(b, ctx)` for idle-time capture."""

    def __init__(self, model, ops, weights, stream, buckets: list[int]):
        self.model, self.ops, self.weights, self.stream = model, ops, weights, stream
        self.buckets = buckets
        self.graphs: dict[int, BucketGraphs] = {}

    def serves(self, batch: ModelBatch) -> bool:
        return (bool(self.buckets) and not batch.is_decode_only and batch.lora_slots is None
                and batch.num_tokens <= self.buckets[-1])

    def bucket(self, tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, tokens)]

    def missing(self) -> list[int]:
        return [b for b in self.buckets if b not in self.graphs]

    def warm(self, b: int, ctx) -> None:
        """Capture bucket b now, on a context of b padded rows."""
        if b not in self.graphs:
            self.graphs[b] = self._capture(ctx)

    def forward(self, ctx):
        """The forward of a step padded to its bucket (ctx.num_tokens): replay the segments, attention
        between them; returns the final-normed hidden states [bucket, H] (the real rows first)."""
        b = ctx.num_tokens
        if b not in self.graphs:
            self.graphs[b] = self._capture(ctx)
        g = self.graphs[b]
        ops = self.ops
        for i, segment in enumerate(g.segments):
            segment.launch(stream=self.stream)
            if i < len(g.holes):
                h = g.holes[i]
                ops.attention(h.q, h.spec, ctx, out=h.out)
        ops.reset(g.ring_after)
        return g.hidden

    # ---- capture ---------------------------------------------------------------------------------
    def _pass(self, ctx, on_attention):
        """One forward with every attention call answered by on_attention(q, spec, ctx) -> out."""
        ops = self.ops
        ops.reset()
        with ops.hooked_attention(on_attention):
            return self.model.forward(ops, self.weights, ctx)

    def _capture(self, ctx) -> BucketGraphs:
        ops, stream = self.ops, self.stream
        width = lambda spec: spec.num_heads * spec.head_dim          # noqa: E731
        self._pass(ctx, lambda q, spec, c: ops.activation(c.num_tokens, width(spec)))   # eager warm-up
        stream.synchronize()
        mode = capture_mode()
        begin = lambda: stream.begin_capture(*mode)                   # noqa: E731
        segments, holes = [], []

        def hole(q, spec, c):
            out = ops.activation(c.num_tokens, width(spec))
            segments.append(stream.end_capture())
            holes.append(Hole(q, spec, out))
            begin()
            return out

        begin()
        try:
            hidden = self._pass(ctx, hole)
        finally:
            segments.append(stream.end_capture())
        return BucketGraphs(segments=segments, holes=holes, hidden=hidden, ring_after=ops.ring_position)
