"""The mixture-of-experts op family in numpy (float32; ops.moe, models/ops.py MoEOps): the router (RouteSpec)
and the routed experts over stacked weights (FP8 experts kept: each expert's products in W8A8, cpu_quant_ops.py;
4-bit ones arrive dequantized to the kernels' bf16 values, engine/executor/cpu.py). The reference the GPU's routing, permutation and grouped-GEMM kernels are checked
against (route_topk and expert_rows are also used by those tests)."""
from __future__ import annotations

import numpy as np

from engine.executor.cpu_dsv4_ops import argsort_stable, sigmoid, sqrtsoftplus, swiglu_limited, xp_of
from engine.executor.cpu_quant_ops import w8a8_linear
from engine.models.ops import RouteSpec
from engine.models.quant_experts import Fp8Experts


def softmax(x: np.ndarray) -> np.ndarray:
    e = xp_of(x).exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


SCORES = {"softmax": softmax, "sigmoid": sigmoid, "sqrtsoftplus": sqrtsoftplus}     # RouteSpec.scoring


def route_topk(logits: np.ndarray, spec: RouteSpec, bias: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(weights float32 [T, k], ids int32 [T, k]) from router logits [T, E], as transformers' routers
    (and DeepSeek's reference Gate): softmax (sigmoid: DeepSeek-V3, sqrtsoftplus: V4) scores;
    choice = scores (+ bias); group-limited: experts outside the topk_groups groups of highest group score
    (the best choice in the group, or with a bias the sum of its top two) drop out; the top_k choices (ties to
    the lower id); their unbiased scores, renormalized when spec.renormalize, times spec.scale. numpy or
    CuPy arrays (the GPU runs it for the scorings moe_route.cu lacks)."""
    xp = xp_of(logits)
    probs = SCORES[spec.scoring](logits.astype(np.float32))
    choice = probs if bias is None else probs + bias.astype(np.float32)
    if spec.num_groups > 1:
        T, G = probs.shape[0], spec.num_groups
        grouped = xp.sort(choice.reshape(T, G, -1), axis=-1)
        best = grouped[..., -1] if bias is None else grouped[..., -1] + grouped[..., -2]   # [T, G]
        keep = argsort_stable(-best)[:, :spec.topk_groups]
        mask = xp.zeros((T, G), bool)
        mask[xp.arange(T)[:, None], keep] = True
        choice = xp.where(xp.repeat(mask, spec.num_experts // G, axis=-1), choice, np.float32(-np.inf))
    ids = argsort_stable(-choice)[:, :spec.top_k]
    weights = xp.take_along_axis(probs, ids, axis=-1)
    if spec.renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return (weights * np.float32(spec.scale)).astype(np.float32), ids.astype(np.int32)


def expert_rows(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The (token, slot) assignments grouped by expert: (order, offsets), order [T·k] the flat
    assignment indices sorted by expert (stable: token order inside a group), offsets [E + 1] each
    expert's first position in order (the permutation the GPU's moe_align kernel builds)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts)
    return order, np.concatenate([[0], np.cumsum(counts)])


def expert_product(x: np.ndarray, w, e: int) -> np.ndarray:
    """x · expert e of w (stacked float32 [E, N, K], or FP8 experts kept: the W8A8 product)ᵀ."""
    return w8a8_linear(x, w.expert(e)) if isinstance(w, Fp8Experts) else x @ w[e].T


class NumpyMoEOps:
    """ops.moe of the numpy executor; silu_mul: the dense ops' SwiGLU (the experts' activation)."""

    def __init__(self, silu_mul):
        self.silu_mul = silu_mul

    def route(self, x, gate_weight, spec: RouteSpec, bias=None):
        return route_topk(x @ gate_weight.T, spec, bias)

    def experts(self, x, gate_up, down, weights, ids, residual, limit=None):
        k = ids.shape[1]
        order, offsets = expert_rows(ids, gate_up.shape[0])
        out = np.array(residual, dtype=np.float32)
        flat_w = weights.reshape(-1)
        for e in np.flatnonzero(np.diff(offsets)):
            sel = order[offsets[e]:offsets[e + 1]]
            tokens = sel // k
            gu = expert_product(x[tokens], gate_up, e)
            y = expert_product(self.silu_mul(gu) if limit is None else swiglu_limited(gu, limit), down, e)
            np.add.at(out, tokens, y * flat_w[sel][:, None])
        return out
