"""DeepSeek-V4's own ops on the GPU, mixed into GpuOps (it provides cp, gemm, stream, kv_cache, moe and
gate_up_interleaved): the hyper-connections, the limited SwiGLU, the hash and sqrtsoftplus routers and the
sliding / compressed attention run as CuPy float32 over the bf16 weights, with every projection on the
executor's bf16 GEMM (float32 out) and the routed experts on the MoE kernels (gpu_moe_ops.py). The
algorithms are cpu_dsv4_ops / cpu_dsv4_attention's own functions, which take CuPy arrays: the CPU gate
checks the code the GPU runs; this file supplies the device primitives (dtype conversion, the KV rows).

Eager steps only: the ops allocate from CuPy's pool, group the step's sequences on the host and copy the
hyper-connection mixes there, so the executor captures no CUDA graphs for this line
(DeepseekV4ForCausalLM.cuda_graphs). A correctness path: its speed is CuPy's element-wise kernels and float32
einsums, host-bound (bench/results/deepseek.md), no roofline claimed.
"""
from __future__ import annotations

import math

import numpy as np

from engine.executor.cpu_dsv4_attention import NumpyDSV4AttentionOps
from engine.executor.cpu_dsv4_ops import hash_route, hc_collapse, hc_merge, hc_mix, hc_weights, hyper_head, swiglu_limited
from engine.executor.cpu_moe_ops import route_topk
from memory.kv_pool import block_view

INTERLEAVE_ROWS = 8     # gate_up rows interleaved in blocks of 8 (memory/weight_upload.py)
WEIGHT_F32_CACHE = 1 << 22      # weights of at most this many elements keep a float32 copy on the device


def bf16_to_f32(cp, a):
    """bf16 bits (uint16) -> float32 values; a float32 array is returned as it is."""
    if a.dtype == np.float32:
        return a
    return (a.astype(cp.uint32) << 16).view(cp.float32)


def f32_to_bf16(cp, a):
    """float32 -> bf16 bits (uint16, round to nearest even), contiguous."""
    u = cp.ascontiguousarray(a, dtype=cp.float32).view(cp.uint32)
    return ((u + (cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1)))) >> 16).astype(cp.uint16)


class GpuDSV4Ops(NumpyDSV4AttentionOps):
    """The DeepSeek-V4 ops of engine/models/deepseek_v4.py on CuPy arrays, on the executor's stream."""

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
        cache = self.__dict__.setdefault("_kept_weights", {})
        hit = cache.get((id(w), form))
        if hit is None:
            hit = cache[(id(w), form)] = (w, convert(w))
        return hit[1]

    def _host(self, a):
        """A device array's values on the host (numpy), after the stream's work so far."""
        return a.get() if hasattr(a, "get") else a

    def _split_gate_up(self, gate_up):
        """gate_up [T, 2I] as float32 [gate | up], undoing the upload's interleave of 8-row blocks."""
        g = self._f(gate_up)
        if not self.gate_up_interleaved:
            return g
        T, two_i = g.shape
        blocks = g.reshape(T, two_i // (2 * INTERLEAVE_ROWS), 2, INTERLEAVE_ROWS)
        return self.cp.concatenate([blocks[:, :, 0].reshape(T, -1), blocks[:, :, 1].reshape(T, -1)], axis=1)

    # ---- residual streams ------------------------------------------------------------------------------
    def hc_streams(self, x, n: int):
        with self.stream:
            return self.cp.repeat(self._f(x)[:, None, :], n, axis=1)

    def hyper_connection(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        """The mixes on the device; pre / post / comb (Sinkhorn: ~6 array ops an iteration on [T, N, N]) in
        numpy after one small copy of the mixes, the host's ops being ~10x cheaper than eager launches."""
        with self.stream:
            mix = self._host(hc_mix(streams, self._weight_f32(fn), norm_eps))
            base, scale = (self._kept(a, "host", lambda v: self._host(self._f(v))) for a in (base, scale))
            pre, post, comb = (self.cp.asarray(a) for a in hc_weights(mix, base, scale, iters, hc_eps))
            return post, comb, self._b(hc_collapse(pre, streams))

    def hc_merge(self, block_out, streams, post, comb):
        with self.stream:
            return hc_merge(self._f(block_out), streams, post, comb)

    def hyper_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        with self.stream:
            s = self._weight_f32(scale).reshape(-1)[:1]          # on the device: no host round trip
            return self._b(hyper_head(streams, self._weight_f32(fn), self._weight_f32(base), s, hc_eps, norm_eps))

    # ---- MLP ---------------------------------------------------------------------------------------------
    def swiglu_limited(self, gate_up, limit):
        with self.stream:
            return self._b(swiglu_limited(self._split_gate_up(gate_up), limit))

    def expert_activation(self, gate_up, out, limit) -> None:
        """The routed experts' SwiGLU into out; with a finite limit, the limited form (else the kernel)."""
        if limit is None or math.isinf(limit):
            return super().expert_activation(gate_up, out, limit)
        with self.stream:
            out[...] = self._b(swiglu_limited(self._split_gate_up(gate_up), limit))

    def _router_logits(self, x, gate_weight):
        T, E = x.shape[0], gate_weight.shape[0]
        logits = self.moe["moe_logits"][:T * E].reshape(T, E)
        self.gemm(x, gate_weight, logits)                    # fp32 output: cuBLAS
        return logits

    def route(self, x, gate_weight, spec, bias=None):
        """moe_route.cu for softmax / sigmoid scores; sqrtsoftplus (DeepSeek-V4) by route_topk on the device."""
        if spec.scoring in ("softmax", "sigmoid"):
            return super().route(x, gate_weight, spec, bias)
        logits = self._router_logits(x, gate_weight)
        with self.stream:
            weights, ids = route_topk(logits, spec, None if bias is None else self._f(bias))
            return self.cp.ascontiguousarray(weights), self.cp.ascontiguousarray(ids)

    def hash_route(self, x, gate_weight, tid2eid, spec, ctx):
        """The experts tid2eid[token] (held as bf16: exact for ids below 256, checked at start by the line)."""
        logits = self._router_logits(x, gate_weight)
        with self.stream:
            table = self._kept(tid2eid, "int32", lambda t: self._f(t).astype(np.int32))
            weights, ids = hash_route(logits, table, ctx.input_ids[:x.shape[0]], spec.scale)
            return self.cp.ascontiguousarray(weights), self.cp.ascontiguousarray(ids)

    # ---- attention: the primitives of NumpyDSV4AttentionOps.dsv4_attention --------------------------------
    def dsv4_attention(self, x, w, spec, ctx):
        with self.stream:
            return super().dsv4_attention(x, w, spec, ctx)

    def _mm(self, x, weight):
        xb = x if x.dtype == np.uint16 else self._b(x)
        out = self.cp.empty((x.shape[0], weight.shape[0]), np.float32)
        self.gemm(self.cp.ascontiguousarray(xb), weight, out)
        return out

    def _fp32(self, weight):
        return self._weight_f32(weight)

    def _dev(self, host):
        return self.cp.asarray(host)

    def _write_rows(self, layer: int, slots, rows) -> None:
        self.kv_cache[layer, 0][self.cp.asarray(slots), 0, :rows.shape[1]] = self._b(rows)

    def _context_rows(self, layer: int, tables, lens, n: int):
        cache, cp = block_view(self.kv_cache[layer, 0]), self.cp
        rows = cache[cp.asarray(tables)].reshape(len(tables), -1, cache.shape[-1])[:, :n]
        real = cp.asarray(np.arange(n)[None, :] < np.asarray(lens)[:, None])
        return cp.where(real[..., None], self._f(rows), np.float32(0))
