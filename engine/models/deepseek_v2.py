"""DeepSeek-V2 / V2-Lite: multi-head latent attention (MLA) and a routed mixture of experts with
shared experts.

Attention (MLASpec in ops.py): one GEMM of the normed hidden gives the query columns (q_proj, or
q_a_proj when q_lora_rank is set: then RMSNorm + q_b_proj), the latent c [kv_lora_rank] and the rope
key [qk_rope_head_dim]. The paged cache stores per token only RMSNorm(c) and the rotated rope key:
kv_layout() is one plane of one head of kv_lora_rank + qk_rope_head_dim values (576 on V2-Lite).
Head h's key is [W_UK_h·c, k_rope] and its value W_UV_h·c (kv_b_proj's rows); the executor attends in
the absorbed form (decode) or expands K and V (prefill). Rope is interleaved (pairs (x[2i], x[2i+1]),
transformers' apply_rotary_emb), on qk_rope_head_dim; with yarn scaling the cos / sin carry
mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax scale qk_head_dim^-0.5 is
multiplied by mscale(factor, mscale_all_dim)^2, as transformers' DeepseekV2Attention does.

MLP: layer i is MoE when n_routed_experts is set, i >= first_k_dense_replace and
i % moe_layer_freq == 0 (DeepSeek's rule; transformers ignores moe_layer_freq, which is 1 in every
released checkpoint): softmax router, top-k greedy or group-limited (n_group groups, the best
topk_group by their highest probability), times routed_scaling_factor, plus n_shared_experts
always-on experts as one SwiGLU MLP of n_shared_experts · moe_intermediate_size. Other layers keep a
dense MLP of intermediate_size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM, LayerOptions, decoder_stack, mlp_block, mlp_weight_specs, \
    model_weight_specs
from engine.models.moe import EXPERT_WEIGHTS, ExpertShape, expert_weight_specs, routed_experts
from engine.models.ops import Array, MLASpec, Ops, RouteSpec
from engine.models.weights import WeightSpec, packed
from memory.kv_pool import KVLayout

TOPK_METHODS = {"greedy": False, "group_limited_greedy": True}     # method -> group-limited


@dataclass(frozen=True)
class DeepseekV2Config:
    """The MLA and MoE fields of a deepseek_v2 config.json (ModelConfig.raw)."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    top_k: int
    first_k_dense_replace: int
    moe_layer_freq: int
    group_limited: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> "DeepseekV2Config":
        cls.check(raw)
        cfg = cls(**cls.fields(raw))
        cfg.validate()
        return cfg

    @staticmethod
    def check(raw: dict[str, Any]) -> None:
        """Refuse the settings this line does not run (a subclass: its own)."""
        method = raw.get("topk_method") or "greedy"
        unsupported = [(method not in TOPK_METHODS, f"topk_method {method!r} (supported: {', '.join(TOPK_METHODS)})"),
                       (raw.get("scoring_func", "softmax") != "softmax", f"scoring_func {raw.get('scoring_func')!r}"),
                       (bool(raw.get("norm_topk_prob")), "norm_topk_prob=true (transformers' DeepseekV2 ignores it)"),
                       (bool(raw.get("attention_bias")), "attention_bias=true")]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"{raw.get('model_type', 'deepseek_v2')}: unsupported {what}")

    @staticmethod
    def fields(raw: dict[str, Any]) -> dict[str, Any]:
        """The dataclass fields from a config.json."""
        group_limited = TOPK_METHODS.get(raw.get("topk_method") or "greedy", False)
        return dict(q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
                    kv_lora_rank=int(raw["kv_lora_rank"]), qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(raw["qk_rope_head_dim"]), v_head_dim=int(raw["v_head_dim"]),
                    n_routed_experts=int(raw.get("n_routed_experts") or 0),
                    n_shared_experts=int(raw.get("n_shared_experts") or 0),
                    moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                    top_k=int(raw.get("num_experts_per_tok") or 0),
                    first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
                    moe_layer_freq=int(raw.get("moe_layer_freq") or 1), group_limited=group_limited,
                    n_group=int(raw.get("n_group") or 1) if group_limited else 1,
                    topk_group=int(raw.get("topk_group") or 1) if group_limited else 1,
                    routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0))

    def validate(self) -> None:
        experts = self.n_routed_experts
        if experts and not 1 <= self.top_k <= experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must lie in 1..n_routed_experts ({experts})")
        if experts and (experts % self.n_group or self.topk_group > self.n_group
                        or self.topk_group * (experts // self.n_group) < self.top_k):
            raise ValueError(f"group-limited routing: {experts} experts in n_group={self.n_group} groups, "
                             f"topk_group={self.topk_group} must hold num_experts_per_tok={self.top_k}")

    def sparse(self, i: int) -> bool:
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def route(self) -> RouteSpec:
        return RouteSpec(num_experts=self.n_routed_experts, top_k=self.top_k, scale=self.routed_scaling_factor,
                         num_groups=self.n_group, topk_groups=self.topk_group)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def softmax_scale(cfg: ModelConfig, mla: DeepseekV2Config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn scaling (transformers'
    yarn_apply_mscale)."""
    scale = mla.qk_head_dim ** -0.5
    s = cfg.rope_scaling or {}
    if (s.get("rope_type") or s.get("type") or "default") != "default" and s.get("mscale_all_dim"):
        factor = float(s["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def mla_block(ops: Ops, w: dict[str, Array], residual: Array, normed: Array | None, spec: MLASpec, ctx: Any,
              opt: LayerOptions, eps: float) -> tuple[Array, Array | None]:
    """residual + o_proj(MLA(rmsnorm(residual))), the latent and rope key written to the paged cache;
    ``normed`` as for decoder.attention_block."""
    i = spec.layer
    y = ops.norm_linear(residual, w[f"layers.{i}.input_layernorm"], eps, w[f"layers.{i}.q_kv_a_proj"], normed=normed)
    if f"layers.{i}.q_b_proj" in w:
        q = ops.mla.latent_cache(y, spec, ctx, w[f"layers.{i}.kv_a_layernorm"], w[f"layers.{i}.q_a_layernorm"])
        o = ops.mla.attention(ops.linear(q, w[f"layers.{i}.q_b_proj"]), w[f"layers.{i}.kv_b_proj"], spec, ctx)
    else:
        o = ops.mla.latent_attention(y, w[f"layers.{i}.kv_b_proj"], spec, ctx, w[f"layers.{i}.kv_a_layernorm"])
    return ops.add_linear_norm(o, w[f"layers.{i}.o_proj"], residual, w[f"layers.{i}.post_attention_layernorm"], eps)


class DeepseekV2ForCausalLM(DecoderLM):
    model_type = "deepseek_v2"
    line_config = DeepseekV2Config          # the MLA / MoE fields (DeepSeek-V3: its own subclass)
    kept_experts = EXPERT_WEIGHTS
    # the dense MLPs and the shared experts (mlp_block: norm_swiglu / add_linear_norm); the latent attention's
    # projections are dequantized
    kept_quantized = ("gate_up_proj", "down_proj")

    def __init__(self, config: ModelConfig):
        self.mla = self.line_config.from_raw(config.raw)
        super().__init__(config)
        m, scale = self.mla, softmax_scale(config, self.mla)
        q_cols = m.q_lora_rank or config.num_attention_heads * m.qk_head_dim
        self.attention_specs = [
            MLASpec(layer=i, num_heads=config.num_attention_heads, q_cols=q_cols, kv_lora_rank=m.kv_lora_rank,
                    nope_dim=m.qk_nope_head_dim, rope_dim=m.qk_rope_head_dim, v_dim=m.v_head_dim,
                    rms_eps=config.rms_norm_eps, scale=scale)
            for i in range(config.num_hidden_layers)]

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        return LayerOptions()

    @property
    def op_families(self) -> frozenset[str]:
        return super().op_families | {"mla"}

    def layer_weight_specs(self, i: int) -> list[WeightSpec]:
        c, m = self.config, self.mla
        H, Hq, R, Dr = c.hidden_size, c.num_attention_heads, m.kv_lora_rank, m.qk_rope_head_dim
        hf = f"model.layers.{i}"
        at = f"{hf}.self_attn"
        q_down = ((f"{at}.q_a_proj.weight", (m.q_lora_rank, H)) if m.q_lora_rank
                  else (f"{at}.q_proj.weight", (Hq * m.qk_head_dim, H)))
        specs = [
            packed(f"layers.{i}.input_layernorm", (f"{hf}.input_layernorm.weight", (H,))),
            packed(f"layers.{i}.q_kv_a_proj", q_down, (f"{at}.kv_a_proj_with_mqa.weight", (R + Dr, H))),
            packed(f"layers.{i}.kv_a_layernorm", (f"{at}.kv_a_layernorm.weight", (R,))),
            packed(f"layers.{i}.kv_b_proj", (f"{at}.kv_b_proj.weight", (Hq * (m.qk_nope_head_dim + m.v_head_dim), R))),
            packed(f"layers.{i}.o_proj", (f"{at}.o_proj.weight", (H, Hq * m.v_head_dim))),
            packed(f"layers.{i}.post_attention_layernorm", (f"{hf}.post_attention_layernorm.weight", (H,))),
        ]
        if m.q_lora_rank:
            specs += [packed(f"layers.{i}.q_a_layernorm", (f"{at}.q_a_layernorm.weight", (m.q_lora_rank,))),
                      packed(f"layers.{i}.q_b_proj", (f"{at}.q_b_proj.weight", (Hq * m.qk_head_dim, m.q_lora_rank)))]
        if not m.sparse(i):
            return specs + mlp_weight_specs(f"layers.{i}.", f"{hf}.mlp", H, c.intermediate_size)
        specs += expert_weight_specs(i, f"{hf}.mlp", m.n_routed_experts, H, m.moe_intermediate_size)
        if m.n_shared_experts:
            specs += mlp_weight_specs(f"layers.{i}.shared_", f"{hf}.mlp.shared_experts", H,
                                      m.n_shared_experts * m.moe_intermediate_size)
        return specs

    def weight_specs(self) -> list[WeightSpec]:
        return model_weight_specs(self.config, self.opt, self.layer_weight_specs)

    def kv_layout(self) -> KVLayout:
        """One latent vector per token and layer: RMSNorm(c) then the rotated rope key."""
        return KVLayout(layers=self.config.num_hidden_layers, planes=1, heads=1,
                        dim=self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)

    @property
    def rope_dim(self) -> int:
        return self.mla.qk_rope_head_dim

    @property
    def activation_width(self) -> int:
        c, m, spec = self.config, self.mla, self.attention_specs[0]
        return max(c.hidden_size, 2 * c.intermediate_size, 2 * m.moe_intermediate_size * max(1, m.n_shared_experts),
                   spec.q_cols + spec.cache_dim, c.num_attention_heads * max(m.qk_head_dim, m.v_head_dim))

    @property
    def expert_shape(self) -> ExpertShape | None:
        m, c = self.mla, self.config
        if not any(m.sparse(i) for i in range(c.num_hidden_layers)):
            return None
        return ExpertShape(m.n_routed_experts, m.top_k, c.hidden_size, m.moe_intermediate_size)

    def mlp(self, ops: Ops, w: dict[str, Array], residual: Array, normed: Array | None, i: int, eps: float,
            next_norm: Array) -> tuple[Array, Array | None]:
        """Layer i's dense MLP, or its routed experts and then its shared experts (whose down
        projection's residual add may compute the next norm)."""
        if not self.mla.sparse(i):
            return mlp_block(ops, w, residual, normed, i, eps, next_norm)
        residual, x = routed_experts(ops, w, residual, normed, i, eps, self.mla.route)
        if not self.mla.n_shared_experts:
            return residual, None
        return mlp_block(ops, w, residual, x, i, eps, next_norm, name="shared_")

    def forward(self, ops: Ops, w: dict[str, Array], ctx: Any) -> Array:
        return decoder_stack(ops, w, ctx, self.config, self.attention_specs, self.opt, attention=mla_block,
                             mlp=self.mlp)
