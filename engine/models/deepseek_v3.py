"""DeepSeek-V3 / Kimi-K2: DeepSeek-V2's line (MLA with q LoRA, shared experts, first_k_dense_replace,
engine/models/deepseek_v2.py) with DeepSeek-V3's router.

Router (transformers' DeepseekV3TopkRouter, DeepSeek's reference Gate with a bias): float32 logits,
sigmoid scores, the choice on scores + e_score_correction_bias (`noaux_tc`): the topk_group of n_group
groups with the highest sum of their two best biased scores, then the top num_experts_per_tok of those;
each chosen expert's weight is its unbiased score, renormalized to sum 1 when norm_topk_prob, times
routed_scaling_factor. The bias is `layers.{i}.router_bias` (moe.routed_experts passes it to the route op).

Every layer from first_k_dense_replace on is MoE (transformers ignores moe_layer_freq: refused unless 1).
Multi-token-prediction layers (num_nextn_predict_layers of them, stored as model.layers.{L}.* with L >=
num_hidden_layers) are not part of the target: left unread at load, with a log line, they draft tokens under
--speculative-config method "mtp" (engine/mtp.py reads the first; `mtp_module` below declares it). Kimi-K2's checkpoints
(model_type kimi_k2 in their config.json) load with this line. Quantized checkpoints (FP8 block scales,
compressed-tensors int4) are dequantized by the loader (engine/loader/quantized.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

from engine.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM, mla_block
from engine.models.mtp_module import MtpModule
from engine.models.ops import Array, Ops, RouteSpec
from engine.models.weights import WeightSpec, packed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepseekV3Config(DeepseekV2Config):
    """DeepseekV2Config with DeepSeek-V3's routing fields."""
    norm_topk_prob: bool = True
    mtp_layers: int = 0
    scoring_func: str = "sigmoid"           # the only one transformers' DeepseekV3 has

    @staticmethod
    def check(raw: dict[str, Any]) -> None:
        what = raw.get("model_type", "deepseek_v3")
        unsupported = [(raw.get("topk_method") not in (None, "noaux_tc"),
                        f"topk_method {raw.get('topk_method')!r} (transformers' DeepseekV3 always routes noaux_tc)"),
                       (raw.get("scoring_func") not in (None, "sigmoid"), f"scoring_func {raw.get('scoring_func')!r}"),
                       (int(raw.get("moe_layer_freq") or 1) != 1, "moe_layer_freq != 1 (transformers ignores it)"),
                       (raw.get("rope_interleave") is False, "rope_interleave=false"),
                       (bool(raw.get("attention_bias")), "attention_bias=true")]
        for bad, name in unsupported:
            if bad:
                raise ValueError(f"{what}: unsupported {name}")

    @staticmethod
    def fields(raw: dict[str, Any]) -> dict[str, Any]:
        n_group = int(raw.get("n_group") or 1)
        return {**DeepseekV2Config.fields({**raw, "topk_method": None}),
                "group_limited": n_group > 1, "n_group": n_group, "topk_group": int(raw.get("topk_group") or 1),
                "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
                "mtp_layers": int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers")) or 0)}

    def validate(self) -> None:
        super().validate()
        if self.n_routed_experts and self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"n_group={self.n_group}: each group needs 2 or more experts (its score is its top-2 sum)")

    @property
    def route(self) -> RouteSpec:
        return RouteSpec(num_experts=self.n_routed_experts, top_k=self.top_k, renormalize=self.norm_topk_prob,
                         scale=self.routed_scaling_factor, num_groups=self.n_group, topk_groups=self.topk_group,
                         scoring=self.scoring_func)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_type = "deepseek_v3"
    line_config = DeepseekV3Config

    def layer_weight_specs(self, i: int) -> list[WeightSpec]:
        """DeepSeek-V2's, and in an MoE layer the router's score correction bias."""
        specs = super().layer_weight_specs(i)
        if self.mla.sparse(i):
            specs.append(packed(f"layers.{i}.router_bias", (f"model.layers.{i}.mlp.gate.e_score_correction_bias",
                                                            (self.mla.n_routed_experts,))))
        return specs

    def checkpoint(self, has: Callable[[str], bool], get: Callable[[str], Any]):
        """The checkpoint as it is; its multi-token-prediction layers are not the target's (said once)."""
        first = self.config.num_hidden_layers
        mtp = [L for L in range(first, first + max(self.mla.mtp_layers, 1))
               if has(f"model.layers.{L}.eh_proj.weight") or has(f"model.layers.{L}.input_layernorm.weight")]
        if self.mla.mtp_layers or mtp:
            log.info("%s: %d multi-token-prediction layer(s) (num_nextn_predict_layers=%d, model.layers.%d+) are not "
                     "part of the target (--speculative-config method 'mtp' drafts with them)", self.model_type,
                     len(mtp), self.mla.mtp_layers, first)
        return has, get

    # ---- the multi-token-prediction module (engine/mtp.py) ----------------------------------------------------
    def mtp_module(self) -> MtpModule:
        L = self.config.num_hidden_layers
        return MtpModule(count=self.mla.mtp_layers, count_key="num_nextn_predict_layers",
                         marker=f"model.layers.{L}.eh_proj.weight", head_norm=True, masks_first=True)

    def mtp_weight_specs(self, layer: int, has: Callable[[str], bool]) -> list[WeightSpec]:
        """The module at model.layers.{layer}: its block's weights as the target's layer `layer` would be, its
        norms, projection and head (mtp.head from lm_head where the module ships none)."""
        H, V = self.config.hidden_size, self.config.vocab_size
        hf = f"model.layers.{layer}"
        head = f"{hf}.shared_head.head.weight" if has(f"{hf}.shared_head.head.weight") else "lm_head.weight"
        return self.layer_weight_specs(layer) + [
            packed("mtp.enorm", (f"{hf}.enorm.weight", (H,))), packed("mtp.hnorm", (f"{hf}.hnorm.weight", (H,))),
            packed("mtp.eh_proj", (f"{hf}.eh_proj.weight", (H, 2 * H))),
            packed("mtp.norm", (f"{hf}.shared_head.norm.weight", (H,))), packed("mtp.head", (head, (V, H)))]

    def mtp_block(self, ops: Ops, w: dict[str, Array], x: Array, layer: int, ctx: Any) -> Array:
        """The module's decoder block (MLA, then the MLP or experts of layer `layer`): h' before shared_head.norm."""
        eps = self.config.rms_norm_eps
        residual, normed = mla_block(ops, w, x, None, replace(self.attention_specs[0], layer=layer), ctx, self.opt,
                                     eps)
        residual, _ = self.mlp(ops, w, residual, normed, layer, eps, w["mtp.norm"])
        return residual
