"""Routed mixture-of-experts layers, shared by the MoE model lines (qwen3_moe.py, deepseek_v2.py).

An MoE layer's MLP is a router (`layers.{i}.router` [E, H], and where the line has one its score
correction bias `layers.{i}.router_bias` [E]) and E SwiGLU experts held as stacked
weights: `layers.{i}.experts_gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows, as
the dense gate_up_proj) and `layers.{i}.experts_down_proj` [E, H, I], packed at load from the
checkpoint's per-expert tensors, so an executor runs each projection as one grouped product.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.ops import Array, Ops, RouteSpec
from engine.models.weights import WeightSpec, packed, stacked


EXPERT_WEIGHTS = ("experts_gate_up_proj", "experts_down_proj")     # DecoderLM.kept_experts of the MoE lines


@dataclass(frozen=True)
class ExpertShape:
    """A model line's routed experts as an executor sizes its buffers: experts, top_k, hidden size and
    each expert's intermediate size (model lines expose it as ``expert_shape``; None: dense)."""
    num_experts: int
    top_k: int
    hidden: int
    inter: int


def expert_weight_specs(i: int, hf: str, experts: int, hidden: int, inter: int) -> list[WeightSpec]:
    """Router and stacked experts of layer i, from `{hf}.gate.weight` and `{hf}.experts.{e}.*`."""
    return [
        packed(f"layers.{i}.router", (f"{hf}.gate.weight", (experts, hidden))),
        stacked(f"layers.{i}.experts_gate_up_proj",
                [[(f"{hf}.experts.{e}.gate_proj.weight", (inter, hidden)),
                  (f"{hf}.experts.{e}.up_proj.weight", (inter, hidden))] for e in range(experts)]),
        stacked(f"layers.{i}.experts_down_proj",
                [[(f"{hf}.experts.{e}.down_proj.weight", (hidden, inter))] for e in range(experts)]),
    ]


def routed_experts(ops: Ops, w: dict[str, Array], residual: Array, normed: Array | None, i: int, eps: float,
                   route: RouteSpec) -> tuple[Array, Array]:
    """(residual + the routed experts' weighted sum over x, x) with x = rmsnorm(residual) by the post-attention
    norm (``normed`` where already computed)."""
    x = normed if normed is not None else ops.rms_norm(residual, w[f"layers.{i}.post_attention_layernorm"], eps)[0]
    weights, ids = ops.moe.route(x, w[f"layers.{i}.router"], route, w.get(f"layers.{i}.router_bias"))
    out = ops.moe.experts(x, w[f"layers.{i}.experts_gate_up_proj"], w[f"layers.{i}.experts_down_proj"],
                          weights, ids, residual)
    return out, x
