"""DeepSeek-V4's own mechanisms in numpy (float32), each one op checked against transformers' module for it
(tests/models/test_dsv4_parts.py); the deepseek_v4 model line (engine/models/deepseek_v4.py) runs them, its attention
(sliding, CSA with the lightning indexer, HCA) is cpu_dsv4_attention.py (docs/models.md, DeepSeek-V4).

* hyper_connection / hc_merge / hyper_head: manifold-constrained hyper-connections (hc_mult residual streams;
  pre / post weights and a Sinkhorn-projected doubly-stochastic comb matrix; transformers'
  DeepseekV4HyperConnection, the decoder layer's mixing, DeepseekV4HyperHead).
* swiglu_limited: the experts' SwiGLU with gate <= limit and |up| <= limit (swiglu_limit).
* router scores "sqrtsoftplus" (cpu_moe_ops.route_topk) and hash_route: DeepSeek-V4's top-k router and its
  hash router (experts from a frozen token-id table, weights from the learned scores).
* sliding_mqa_attention: one shared K = V head of head_dim for every query head, partial interleaved rope on
  each head's trailing rope dims, a sliding window, a learned per-head sink in the softmax, the rope undone on
  the output (rotation by -position); grouped_linear: the grouped output projection's block-diagonal part.

The functions take numpy or CuPy arrays (xp_of): the GPU executor runs the same code on the device
(engine/executor/gpu_dsv4_ops.py), so what the CPU gate checks is what the GPU computes. The numpy executor's
DeepSeek-V4 part (ops.dsv4) is cpu_dsv4_attention.NumpyDSV4Ops.
"""
from __future__ import annotations

import numpy as np


def xp_of(a):
    """The array module of `a`: CuPy for a CuPy array, else numpy."""
    if type(a).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def argsort_stable(a, axis: int = -1):
    """Stable argsort along axis (numpy's "stable", CuPy's only kind): ties keep the lower index first."""
    return xp_of(a).argsort(a, axis=axis, kind="stable")


def rms(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    xp = xp_of(x)
    y = x * (np.float32(1) / xp.sqrt(xp.mean(xp.square(x), axis=-1, keepdims=True) + np.float32(eps)))
    return y if weight is None else y * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + xp_of(x).exp(-x))


def hc_mix(streams: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    """The mixes [T, (2 + N)·N] of the streams [T, N, D]: rmsnorm(flat streams) · fnᵀ."""
    T, N, D = streams.shape
    return rms(streams.reshape(T, N * D), norm_eps) @ fn.T


def hc_weights(mix: np.ndarray, base: np.ndarray, scale: np.ndarray, iters: int, hc_eps: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre [T, N], post [T, N], comb [T, N, N]) of the mixes: pre = sigmoid(mix·s0 + b) + eps,
    post = 2·sigmoid(mix·s1 + b), comb = softmax(mix·s2 + b) + eps, then Sinkhorn: columns normalized, then
    iters - 1 times rows and columns."""
    xp, T = xp_of(mix), mix.shape[0]
    N = int(round((mix.shape[1] + 1) ** 0.5)) - 1                             # (2 + N)·N columns
    pre_w, post_w, comb_w = mix[:, :N], mix[:, N:2 * N], mix[:, 2 * N:].reshape(T, N, N)
    pre_b, post_b, comb_b = base[:N], base[N:2 * N], base[2 * N:].reshape(N, N)
    pre = sigmoid(pre_w * scale[0] + pre_b) + np.float32(hc_eps)
    post = np.float32(2) * sigmoid(post_w * scale[1] + post_b)
    logits = comb_w * scale[2] + comb_b
    comb = xp.exp(logits - logits.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + np.float32(hc_eps)
    comb = comb / (comb.sum(-2, keepdims=True) + np.float32(hc_eps))
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + np.float32(hc_eps))
        comb = comb / (comb.sum(-2, keepdims=True) + np.float32(hc_eps))
    return pre, post, comb


def hc_collapse(pre: np.ndarray, streams: np.ndarray) -> np.ndarray:
    """sum_n pre_n · stream_n: [T, D]."""
    return xp_of(streams).einsum("tn,tnd->td", pre, streams)


def hyper_connection(streams: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, iters: int,
                     hc_eps: float, norm_eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """streams [T, N, D] -> (post [T, N], comb [T, N, N], collapsed [T, D]): hc_weights of hc_mix, and the
    streams collapsed by pre."""
    pre, post, comb = hc_weights(hc_mix(streams, fn, norm_eps), base, scale, iters, hc_eps)
    return post, comb, hc_collapse(pre, streams)


def hc_merge(block_out: np.ndarray, streams: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """The new streams [T, N, D]: post_n · block_out + sum_j comb[j, n] · stream_j (comb applied transposed)."""
    return post[..., None] * block_out[:, None, :] + xp_of(streams).einsum("tjn,tjd->tnd", comb, streams)


def hyper_head(streams: np.ndarray, fn: np.ndarray, base: np.ndarray, scale, hc_eps: float,
               norm_eps: float) -> np.ndarray:
    """The final collapse of the streams [T, N, D] -> [T, D] (pre weights only); scale: float32 [1]."""
    T, N, D = streams.shape
    pre = sigmoid((rms(streams.reshape(T, N * D), norm_eps) @ fn.T) * scale + base) + np.float32(hc_eps)
    return xp_of(streams).einsum("tn,tnd->td", pre, streams)


def swiglu_limited(gate_up: np.ndarray, limit: float) -> np.ndarray:
    """gate_up [T, 2I] -> silu(min(gate, limit)) · clip(up, -limit, limit)."""
    xp, half = xp_of(gate_up), gate_up.shape[-1] // 2
    g = xp.minimum(gate_up[:, :half], np.float32(limit))
    u = xp.clip(gate_up[:, half:], np.float32(-limit), np.float32(limit))
    return g * sigmoid(g) * u


def sqrtsoftplus(x: np.ndarray) -> np.ndarray:
    """sqrt(softplus(x)), softplus as torch's (x itself above 20)."""
    xp, x = xp_of(x), x.astype(np.float32)
    return xp.sqrt(xp.where(x > 20, x, xp.log1p(xp.exp(xp.minimum(x, np.float32(20))))))


def hash_route(logits: np.ndarray, tid2eid: np.ndarray, input_ids: np.ndarray, scale: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k], ids [T, k]): the experts tid2eid[token] (a frozen table [V, k]); their sqrtsoftplus
    scores, renormalized to sum 1, times scale."""
    xp = xp_of(logits)
    ids = tid2eid[input_ids].astype(np.int32)
    w = xp.take_along_axis(sqrtsoftplus(logits), ids, axis=-1)
    return (w / w.sum(-1, keepdims=True) * np.float32(scale)).astype(np.float32), ids


def rope_trailing(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved rope on the trailing 2·cos.shape[-1] dims of x [T, H, D] (pairs (2i, 2i + 1)); cos, sin [T, R/2]."""
    r = 2 * cos.shape[-1]
    out = xp_of(x).array(x, dtype=np.float32)
    a, b = x[..., -r::2], x[..., -r + 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., -r::2] = a * c - b * s
    out[..., -r + 1::2] = b * c + a * s
    return out


def sink_attention(q: np.ndarray, keys: np.ndarray, visible: np.ndarray, sinks: np.ndarray, scale: float
                   ) -> np.ndarray:
    """q [..., T, H, D] over keys [..., L, D] that are also the values (K = V), where visible [..., T, L]; head
    h's sink logit takes part in the softmax's denominator only. Returns o [..., T, H, D]."""
    xp = xp_of(q)
    scores = xp.where(visible[..., :, None, :], xp.einsum("...thd,...ld->...thl", q, keys) * np.float32(scale),
                      np.float32(-np.inf))
    m = xp.maximum(scores.max(-1, keepdims=True), sinks[None, :, None])
    p = xp.exp(scores - m)
    p = p / (p.sum(-1, keepdims=True) + xp.exp(sinks[None, :, None] - m))
    return xp.einsum("...thl,...ld->...thd", p, keys)


def sliding_mqa_attention(q: np.ndarray, kv: np.ndarray, q_pos: np.ndarray, kv_pos: np.ndarray, window: int,
                          sinks: np.ndarray, scale: float) -> np.ndarray:
    """sink_attention of q [T, H, D] (rope applied) over the one shared K = V head kv [L, D] at the positions p
    with q_pos - window < p <= q_pos. Returns o [T, H, D] (before the output rope is undone)."""
    d = q_pos[:, None] - kv_pos[None, :]
    return sink_attention(q, kv, (d >= 0) & (d < window), sinks, scale)


def grouped_linear(x: np.ndarray, weight: np.ndarray, groups: int) -> np.ndarray:
    """x [T, groups·K] split into `groups` slices, slice g times its own rows of weight [groups·N, K]:
    [T, groups·N] (the grouped output projection's first part, o_a_proj)."""
    T = x.shape[0]
    w = weight.reshape(groups, -1, weight.shape[-1])                        # [g, N, K]
    return xp_of(x).einsum("tgk,gnk->tgn", x.reshape(T, groups, -1), w).reshape(T, -1)
