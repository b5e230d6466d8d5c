"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (GQA, per-head q/k norm, neox rope),
and in the sparse layers a routed mixture of experts in place of the MLP: softmax router over
num_experts, the top num_experts_per_tok, renormalized to sum 1 when norm_topk_prob; no shared
experts. A layer is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0;
the others keep a dense MLP of intermediate_size.

Forward: decoder_stack with Qwen3's attention block and, per layer, the dense mlp_block or
moe.routed_experts (router + one grouped product per projection + the weighted sum into the residual).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.model_config import ModelConfig
from engine.models.decoder import (attention_weight_specs, decoder_stack, mlp_block,
                                   mlp_weight_specs, model_weight_specs)
from engine.models.moe import EXPERT_WEIGHTS, ExpertShape, expert_weight_specs, routed_experts
from engine.models.ops import Array, Ops, RouteSpec
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.weights import WeightSpec


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """The MoE fields of a qwen3_moe config.json (ModelConfig.raw)."""
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> "Qwen3MoeConfig":
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        for key, value in (("num_experts", experts), ("num_experts_per_tok", raw.get("num_experts_per_tok")),
                           ("moe_intermediate_size", raw.get("moe_intermediate_size"))):
            if value is None:
                raise ValueError(f"config.json (qwen3_moe) is missing {key!r}")
        cfg = cls(num_experts=int(experts), top_k=int(raw["num_experts_per_tok"]),
                  moe_intermediate_size=int(raw["moe_intermediate_size"]),
                  norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                  decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                  mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
        if cfg.num_experts and not 1 <= cfg.top_k <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok {cfg.top_k} must lie in 1..num_experts ({cfg.num_experts})")
        return cfg

    def sparse(self, i: int) -> bool:
        """Whether layer i routes to experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def route(self) -> RouteSpec:
        return RouteSpec(num_experts=self.num_experts, top_k=self.top_k, renormalize=self.norm_topk_prob)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_type = "qwen3_moe"
    # Capturable (routing and grouping run on the device with grids fixed by T; the GPU gates pass with it
    # on) but off: a 1024-token prefill of Qwen3-30B-A3B is GPU-bound (34 ms, launch 27.5 -> 11 ms with
    # it), and capturing the 19 buckets while idle delayed concurrency-1 requests (TTFT 36.5 -> 88 ms,
    # H200, 2026-12-04: bench/results/moe.md)
    piecewise_graphs = False
    layerwise_restore = False          # its attention is Qwen3's, but the path is not yet measured on the GPU
    lora = False                       # the routed experts are no LoRA sites
    kept_experts = EXPERT_WEIGHTS

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.moe = Qwen3MoeConfig.from_raw(config.raw)

    def layer_weight_specs(self, i: int) -> list[WeightSpec]:
        c, hf = self.config, f"model.layers.{i}.mlp"
        mlp = (expert_weight_specs(i, hf, self.moe.num_experts, c.hidden_size, self.moe.moe_intermediate_size)
               if self.moe.sparse(i) else mlp_weight_specs(f"layers.{i}.", hf, c.hidden_size, c.intermediate_size))
        return attention_weight_specs(c, i, self.opt) + mlp

    def weight_specs(self) -> list[WeightSpec]:
        return model_weight_specs(self.config, self.opt, self.layer_weight_specs)

    @property
    def activation_width(self) -> int:
        return max(super().activation_width, 2 * self.moe.moe_intermediate_size)

    @property
    def expert_shape(self) -> ExpertShape | None:
        m, c = self.moe, self.config
        if not any(m.sparse(i) for i in range(c.num_hidden_layers)):
            return None
        return ExpertShape(m.num_experts, m.top_k, c.hidden_size, m.moe_intermediate_size)

    def mlp(self, ops: Ops, w: dict[str, Array], residual: Array, normed: Array | None, i: int, eps: float,
            next_norm: Array) -> tuple[Array, Array | None]:
        """Layer i's dense MLP or routed experts (whose residual add leaves the next norm to the next op)."""
        if not self.moe.sparse(i):
            return mlp_block(ops, w, residual, normed, i, eps, next_norm)
        return routed_experts(ops, w, residual, normed, i, eps, self.moe.route)[0], None

    def forward(self, ops: Ops, w: dict[str, Array], ctx: Any) -> Array:
        return decoder_stack(ops, w, ctx, self.config, self.attention_specs, self.opt, mlp=self.mlp)
