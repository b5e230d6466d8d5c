"""DeepSeek-V4's op family on the GPU (ops.dsv4; models/ops.py DSV4Ops), a part GpuOps builds for that line over
the executor's GpuShared and its MoE part: the hyper-connections, the limited SwiGLU, the hash router and the
sliding / compressed attention run as CuPy float32 over the bf16 weights, with every projection on the
executor's bf16 GEMM (float32 out) and the routed experts on the MoE part (gpu_moe_ops.py, which also takes the
sqrtsoftplus router and the limited SwiGLU of the experts). The algorithms are cpu_dsv4_ops /
cpu_dsv4_attention's own functions, which take CuPy arrays: the CPU gate checks the code the GPU runs; this file
supplies the device primitives (dtype conversion, the KV rows).

Eager steps only: the ops allocate from CuPy's pool, group the step's sequences on the host and copy the
hyper-connection mixes there, so the executor captures no CUDA graphs for this line
(DeepseekV4ForCausalLM.cuda_graphs). A correctness path: its speed is CuPy's element-wise kernels and float32
einsums, host-bound (bench/results/deepseek.md), no roofline claimed.
"""
from __future__ import annotations

import numpy as np

from engine.executor.cpu_dsv4_attention import dsv4_attention, slots_at
from engine.executor.cpu_dsv4_ops import hash_route, hc_collapse, hc_merge, hc_mix, hc_weights, hyper_head, swiglu_limited
from engine.executor.gpu_bf16 import bf16_to_f32, f32_to_bf16, split_gate_up

WEIGHT_F32_CACHE = 1 << 22      # weights of at most this many elements keep a float32 copy on the device


class GpuDSV4Ops:
    """ops.dsv4 on CuPy arrays, on the executor's stream; moe: the executor's MoE part (its router logits)."""

    def __init__(self, shared, moe):
        import cupy

        self.shared, self.moe, self.cp = shared, moe, cupy
        self._kept_weights: dict = {}       # (id(weight), form) -> (weight, converted)

    def _f(self, a):
        return bf16_to_f32(self.cp, a)

    def _b(self, a):
        return f32_to_bf16(self.cp, a)

    def _weight_f32(self, w):
        """A weight's float32 values, converted once and kept for weights up to WEIGHT_F32_CACHE elements (the
        norms, sinks, hyper-connection and router tables); the large projections go through the bf16 GEMM."""
        if w.dtype == np.float32 or w.size > WEIGHT_F32_CACHE:
            return self._f(w)
        return self._kept(w, "f32", self._f)

    def _kept(self, w, form: str, convert):
        """convert(w), computed on first use and kept with w (held, so its id stays its own)."""
        hit = self._kept_weights.get((id(w), form))
        if hit is None:
            hit = self._kept_weights[(id(w), form)] = (w, convert(w))
        return hit[1]

    def _host(self, a):
        """A device array's values on the host (numpy), after the stream's work so far."""
        return a if isinstance(a, np.ndarray) else a.get()

    # ---- residual streams ------------------------------------------------------------------------------
    def hc_streams(self, x, n: int):
        with self.shared.stream:
            return self.cp.repeat(self._f(x)[:, None, :], n, axis=1)

    def hyper_connection(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        """The mixes on the device; pre / post / comb (Sinkhorn: ~6 array ops an iteration on [T, N, N]) in
        numpy after one small copy of the mixes, the host's ops being ~10x cheaper than eager launches."""
        with self.shared.stream:
            mix = self._host(hc_mix(streams, self._weight_f32(fn), norm_eps))
            base, scale = (self._kept(a, "host", lambda v: self._host(self._f(v))) for a in (base, scale))
            pre, post, comb = (self.cp.asarray(a) for a in hc_weights(mix, base, scale, iters, hc_eps))
            return post, comb, self._b(hc_collapse(pre, streams))

    def hc_merge(self, block_out, streams, post, comb):
        with self.shared.stream:
            return hc_merge(self._f(block_out), streams, post, comb)

    def hyper_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        with self.shared.stream:
            s = self._weight_f32(scale).reshape(-1)[:1]          # on the device: no host round trip
            return self._b(hyper_head(streams, self._weight_f32(fn), self._weight_f32(base), s, hc_eps, norm_eps))

    # ---- MLP -------------------------------------------------------------------------------------------
    def swiglu_limited(self, gate_up, limit):
        with self.shared.stream:
            g = split_gate_up(self.cp, self._f(gate_up), self.shared.gate_up_interleaved)
            return self._b(swiglu_limited(g, limit))

    def hash_route(self, x, gate_weight, tid2eid, spec, ctx):
        """The experts tid2eid[token] (held as bf16: exact for ids below 256, checked at start by the line)."""
        logits = self.moe.router_logits(x, gate_weight)
        with self.shared.stream:
            table = self._kept(tid2eid, "int32", lambda t: self._f(t).astype(np.int32))
            weights, ids = hash_route(logits, table, ctx.input_ids[:x.shape[0]], spec.scale)
            return self.cp.ascontiguousarray(weights), self.cp.ascontiguousarray(ids)

    # ---- attention: cpu_dsv4_attention.dsv4_attention over the device primitives --------------------------
    def attention(self, x, w, spec, ctx):
        with self.shared.stream:
            return dsv4_attention(x, w, spec, ctx, self)

    def mm(self, x, weight):
        xb = x if x.dtype == np.uint16 else self._b(x)
        out = self.cp.empty((x.shape[0], weight.shape[0]), np.float32)
        self.shared.gemm(self.cp.ascontiguousarray(xb), weight, out)
        return out

    def fp32(self, weight):
        return self._weight_f32(weight)

    def dev(self, host):
        return self.cp.asarray(host)

    def write_rows(self, layer: int, slots, rows, col: int = 0) -> None:
        self.shared.kv_cache[layer, 0][self.cp.asarray(slots), 0, col:col + rows.shape[1]] = self._b(rows)

    def rows_at(self, layer: int, tables, at, col: int, width: int):
        rows = self.shared.kv_cache[layer, 0][self.cp.asarray(slots_at(tables, at)), 0, col:col + width]
        return self.cp.where(self.cp.asarray(at >= 0)[..., None], self._f(rows), np.float32(0))

    def block_out(self, y):
        return y                            # float32: hc_merge reads it as it is
