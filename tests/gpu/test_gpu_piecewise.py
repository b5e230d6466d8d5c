"""Piecewise graphs of eager steps (engine/executor/gpu_piecewise.py) without a GPU: a stand-in stream
whose captures record the ops launched under them, graphs that run what they recorded, and a model
forward of three layers. The replay must run exactly the eager forward's kernels in order, each
attention launched between the segments with the step's context and the output rows the capture handed
to the next segment; the ring is left where the capture left it."""
from __future__ import annotations

import contextlib
import types

import pytest

from engine.executor.gpu_piecewise import PiecewiseGraphs, eager_buckets


class Stream:
    def __init__(self):
        self.capture: list | None = None
        self.ran: list = []

    def begin_capture(self, *mode):
        assert self.capture is None, "nested capture"
        self.capture = []

    def end_capture(self):
        graph, self.capture = Graph(self.capture), None
        return graph

    def launch(self, item):
        (self.capture if self.capture is not None else self.ran).append(item)

    def synchronize(self):
        pass


class Graph:
    def __init__(self, items):
        self.items = items

    def launch(self, stream):
        assert stream.capture is None
        stream.ran.extend(self.items)


class Ops:
    """Ops whose every kernel is a (name, layer) item on the stream; buffers are ring slot numbers. The
    piecewise graphs' hook as GpuOps has it: reset / ring_position / activation / hooked_attention."""

    def __init__(self, stream):
        self.stream, self.ring_next, self.hook = stream, 0, None

    def reset(self, at: int = 0):
        self.ring_next = at

    @property
    def ring_position(self):
        return self.ring_next

    def activation(self, rows, cols):
        slot, self.ring_next = self.ring_next, (self.ring_next + 1) % 10
        return ("ring", slot, rows, cols)

    @contextlib.contextmanager
    def hooked_attention(self, hook):
        self.hook = hook
        try:
            yield
        finally:
            self.hook = None

    def op(self, name, layer):
        self.stream.launch((name, layer))
        return self.activation(4, 8)

    def attention(self, q, spec, ctx, out=None):
        if self.hook is not None:
            return self.hook(q, spec, ctx)
        out = out if out is not None else self.activation(ctx.num_tokens, spec.num_heads * spec.head_dim)
        self.stream.launch(("attention", spec.layer, q, out, ctx.step))
        return out


class Model:
    layers = 3

    def forward(self, ops, w, ctx):
        ops.op("embed", -1)
        for i in range(self.layers):
            q = ops.op("qkv+rope", i)
            spec = types.SimpleNamespace(layer=i, num_heads=2, head_dim=4)
            o = ops.attention(q, spec, ctx)
            assert o[0] == "ring"
            ops.op("o+mlp", i)
        return ops.op("norm", -1)


def ctx(step, tokens=64):
    return types.SimpleNamespace(num_tokens=tokens, step=step)


def eager_run(step):
    stream = Stream()
    ops = Ops(stream)
    hidden = Model().forward(ops, {}, ctx(step))
    return stream.ran, hidden, ops.ring_next


@pytest.mark.parametrize("warm", [True, False])
def test_replay_runs_the_eager_forward_with_attention_between_segments(warm):
    stream = Stream()
    ops = Ops(stream)
    pw = PiecewiseGraphs(Model(), ops, {}, stream, eager_buckets(4096, 256))
    if warm:                                            # captured while idle, on padded rows
        pw.warm(64, ctx("padding"))
        assert pw.missing() == [b for b in pw.buckets if b != 64]
        stream.ran.clear()
    for step in ("step 1", "step 2"):
        stream.ran.clear()
        ops.ring_next = 7                               # wherever the step before left it
        hidden = pw.forward(ctx(step))
        ran = [r for r in stream.ran if r[0] != "attention" or r[4] == step]
        if not warm and step == "step 1":               # captured on first use: the eager warm-up pass ran
            ran = ran[len(ran) - len(eager_run(step)[0]):]
        want, want_hidden, want_ring = eager_run(step)
        assert ran == want and hidden == want_hidden and ops.ring_next == want_ring
    g = pw.graphs[64]
    assert len(g.segments) == Model.layers + 1 and len(g.holes) == Model.layers
    assert "attention" not in vars(ops)                 # the class's op is back


def test_attention_wrapper_is_put_back():
    stream = Stream()
    ops = Ops(stream)
    wrapper = ops.attention
    ops.attention = wrapper                              # an instance attribute (a profiler's)
    PiecewiseGraphs(Model(), ops, {}, stream, [64]).warm(64, ctx("padding"))
    assert vars(ops)["attention"] is wrapper


def test_buckets_and_serves():
    assert eager_buckets(8192, 0) == []
    assert eager_buckets(8192, 512) == [16, 32, 64, 128, 256, 384, 512]
    assert eager_buckets(300, 2048) == [16, 32, 64, 128, 256, 300]
    pw = PiecewiseGraphs(Model(), None, {}, None, eager_buckets(8192, 512))
    batch = lambda T, decode=False, lora=None: types.SimpleNamespace(  # noqa: E731
        num_tokens=T, is_decode_only=decode, lora_slots=lora)
    assert pw.serves(batch(500)) and pw.bucket(500) == 512 and pw.bucket(129) == 256 and pw.bucket(1) == 16
    assert not pw.serves(batch(513))                    # larger steps launch kernel by kernel
    assert not pw.serves(batch(8, decode=True))         # decode steps have their own graphs
    assert not pw.serves(batch(100, lora=[0]))          # LoRA steps stay eager
