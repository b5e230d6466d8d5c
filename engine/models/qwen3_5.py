"""Qwen3.5 (dense text model): a hybrid of Gated DeltaNet (linear attention) and gated full attention.

`layer_types` names each decoder layer (Qwen3.5-4B: 3 linear, then 1 full, 8 times). Every layer is
pre-norm with a SwiGLU MLP; every RMSNorm but the DeltaNet's gated one scales by (1 + w).
  * full attention: q_proj gives the query and a sigmoid output gate per head; q/k RMSNorm, rotary
    on the first partial_rotary_factor · head_dim dims, GQA over the paged KV cache, o · sigmoid(gate).
  * Gated DeltaNet: one input projection [q k v | z | b | a]; a depthwise causal conv (width
    linear_conv_kernel_dim, SiLU) over q k v with a conv state per sequence; the gated delta rule over a
    float32 recurrent state [Hv, Dk, Dv] per sequence (key heads may be fewer than value heads);
    a gated RMSNorm (· silu(z)); out_proj.
The recurrent and conv states live in the sequence's state slot (memory/state_slots.py), declared by
`state_layout()`; the paged KV holds the full-attention layers only (`kv_layout()`).

Two checkpoint forms load: `qwen3_5_text` (weights under `model.*`) and the composite `qwen3_5`
(vision-language; the text model under `model.language_model.*`, its lm_head tied per the top-level
tie_word_embeddings; the vision tower is not loaded). The engine's layout differs from the
checkpoint's in three ways, all applied at load (`checkpoint`):
  * (1 + w) norm weights are stored as 1 + w (float32), so the plain RMSNorm ops serve;
  * q_proj's per-head [query | gate] rows are split into the query rows of qkv_proj and attn_gate_proj;
  * with partial rotary, each q / k head's dims are permuted so that the checkpoint's rotary pairs
    (i, i + rot/2) sit at (i, i + D/2) and the dims that do not rotate get frequency 0 (rope.py); the
    scores q·k do not change under a permutation of both, v is not permuted;
  * the DeltaNet input projection [qkv | z | b | a] gets zero rows up to a multiple of 8 (the GPU's
    GEMMs take N % 8 == 0; Qwen3.5-4B's 12352 rows need none).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM, LayerOptions, mlp_block, mlp_weight_specs
from engine.models.mtp_module import MtpModule
from engine.models.ops import Array, AttentionSpec, LinearAttentionSpec, Ops
from engine.models.rope import partial_rotary_factor, rotary_dim
from engine.models.weights import WeightSpec, packed
from memory.kv_pool import KVLayout
from memory.state_slots import ACTIVATION, StateArray, StateLayout

LINEAR, FULL = "linear_attention", "full_attention"
PLUS_ONE_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
PLUS_ONE_TOP = ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.pre_fc_norm_embedding.weight")
QUERY, GATE = "#query", "#gate"             # q_proj split into its query and gate rows (engine-side names)
PAD = "#zeros"                              # zero rows padding the DeltaNet input projection to a multiple of 8
PROJ_ALIGN = 8


def layer_types(cfg: ModelConfig) -> list[str]:
    """The kind of every decoder layer (default: every full_attention_interval-th layer is full)."""
    types = cfg.raw.get("layer_types")
    if types is None:
        every = int(cfg.raw.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must list {cfg.num_hidden_layers} of {LINEAR!r} / {FULL!r}, got {types}")
    return list(types)


def rotary_permutation(head_dim: int, rot: int) -> np.ndarray:
    """Engine dim d of a q / k head holds checkpoint dim perm[d]: the rotary pairs (i, i + rot/2) of the
    checkpoint at (i, i + D/2), the other dims after them in each half, in order."""
    half, r2 = head_dim // 2, rot // 2
    rest = np.arange(rot, head_dim)
    return np.concatenate([np.arange(r2), rest[:half - r2], np.arange(r2, rot), rest[half - r2:]])


def text_model_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A composite config's text_config with the composite's model_type and tie_word_embeddings (the
    composite model ties its lm_head, as transformers does), ids and dtype taken from the top level
    where the text config has none."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json ({d.get('model_type')}) has no text_config")
    out = dict(text)
    for key in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype"):
        if out.get(key) is None and d.get(key) is not None:
            out[key] = d[key]
    out["model_type"] = d["model_type"]
    out["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    return out


class Qwen3_5ForCausalLM(DecoderLM):
    model_type = "qwen3_5_text"
    prefix = "model."                       # where the checkpoint keeps the text model

    def __init__(self, config: ModelConfig):
        # transformers' Qwen3.5 config defaults partial_rotary_factor to 0.25 (rope.py reads raw)
        params = config.raw.get("rope_parameters") or {}
        if "partial_rotary_factor" not in params and "partial_rotary_factor" not in config.raw:
            config.raw["partial_rotary_factor"] = 0.25
        self.config = config
        self.opt = self.layer_options(config)
        self.types = layer_types(config)
        r = config.raw
        self.linear_specs: dict[int, LinearAttentionSpec] = {}
        self.attention_layers: dict[int, AttentionSpec] = {}
        for i, kind in enumerate(self.types):
            if kind == LINEAR:
                self.linear_specs[i] = LinearAttentionSpec(
                    layer=len(self.linear_specs), num_k_heads=int(r.get("linear_num_key_heads", 16)),
                    num_v_heads=int(r.get("linear_num_value_heads", 32)), k_dim=int(r.get("linear_key_head_dim", 128)),
                    v_dim=int(r.get("linear_value_head_dim", 128)), conv_kernel=int(r.get("linear_conv_kernel_dim", 4)),
                    rms_eps=config.rms_norm_eps)
            else:
                self.attention_layers[i] = AttentionSpec(
                    layer=len(self.attention_layers), num_heads=config.num_attention_heads,
                    num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                    rms_eps=config.rms_norm_eps, scale=config.head_dim ** -0.5)
        self.attention_specs = list(self.attention_layers.values())
        spec = next(iter(self.linear_specs.values()), None)
        if spec is not None and spec.num_v_heads % spec.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({spec.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({spec.num_k_heads})")
        if config.head_dim % 2 or rotary_dim(config) % 2:
            raise ValueError(f"head_dim {config.head_dim} and its rotary part {rotary_dim(config)} must be even")

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        if config.attention_bias:
            raise ValueError("unsupported: Qwen3.5 with attention_bias=true")
        return LayerOptions(qk_norm=True)

    op_families = frozenset({"deltanet"})     # the Gated DeltaNet layers and the gated attention's output gate

    # ---- declarations -------------------------------------------------------------------------
    def weight_specs(self) -> list[WeightSpec]:
        c = self.config
        V, H = c.vocab_size, c.hidden_size
        specs = [packed("embed_tokens", ("model.embed_tokens.weight", (V, H)))]
        for i in range(c.num_hidden_layers):
            hf = f"model.layers.{i}"
            specs.append(packed(f"layers.{i}.input_layernorm", (f"{hf}.input_layernorm.weight", (H,))))
            if i in self.linear_specs:
                specs += self._linear_weights(i, self.linear_specs[i])
            else:
                specs += self._attention_weights(i, hf)
            specs += self._mlp_weights(i, hf)
        specs.append(packed("norm", ("model.norm.weight", (H,))))
        if not c.tie_word_embeddings:
            specs.append(packed("lm_head", ("lm_head.weight", (V, H))))
        return specs

    def _mlp_weights(self, i: int, hf: str) -> list[WeightSpec]:
        """Layer i's post-attention norm and SwiGLU MLP at checkpoint prefix hf."""
        H = self.config.hidden_size
        return [packed(f"layers.{i}.post_attention_layernorm", (f"{hf}.post_attention_layernorm.weight", (H,))),
                *mlp_weight_specs(f"layers.{i}.", f"{hf}.mlp", H, self.config.intermediate_size)]

    def _attention_weights(self, i: int, hf: str) -> list[WeightSpec]:
        """Gated full attention of engine layer i at checkpoint prefix hf."""
        c = self.config
        H, D, q, kv = c.hidden_size, c.head_dim, c.q_size, c.kv_size
        at = f"{hf}.self_attn"
        return [packed(f"layers.{i}.qkv_proj", (f"{at}.q_proj.weight{QUERY}", (q, H)),
                       (f"{at}.k_proj.weight", (kv, H)), (f"{at}.v_proj.weight", (kv, H))),
                packed(f"layers.{i}.attn_gate_proj", (f"{at}.q_proj.weight{GATE}", (q, H))),
                packed(f"layers.{i}.o_proj", (f"{at}.o_proj.weight", (H, q))),
                packed(f"layers.{i}.q_norm", (f"{at}.q_norm.weight", (D,))),
                packed(f"layers.{i}.k_norm", (f"{at}.k_norm.weight", (D,)))]

    def _linear_weights(self, i: int, s: LinearAttentionSpec) -> list[WeightSpec]:
        H = self.config.hidden_size
        la = f"model.layers.{i}.linear_attn"
        pad = -s.proj_size % PROJ_ALIGN
        return [packed(f"layers.{i}.in_proj", (f"{la}.in_proj_qkv.weight", (s.conv_dim, H)),
                       (f"{la}.in_proj_z.weight", (s.value_size, H)), (f"{la}.in_proj_b.weight", (s.num_v_heads, H)),
                       (f"{la}.in_proj_a.weight", (s.num_v_heads, H)), *([(f"{la}{PAD}", (pad, H))] if pad else [])),
                packed(f"layers.{i}.conv1d", (f"{la}.conv1d.weight", (s.conv_dim, 1, s.conv_kernel))),
                packed(f"layers.{i}.A_log", (f"{la}.A_log", (s.num_v_heads,))),
                packed(f"layers.{i}.dt_bias", (f"{la}.dt_bias", (s.num_v_heads,))),
                packed(f"layers.{i}.linear_norm", (f"{la}.norm.weight", (s.v_dim,))),
                packed(f"layers.{i}.out_proj", (f"{la}.out_proj.weight", (H, s.value_size)))]

    def kv_layout(self) -> KVLayout:
        """K and V of the full-attention layers only."""
        c = self.config
        return KVLayout(layers=len(self.attention_specs), planes=2, heads=c.num_key_value_heads, dim=c.head_dim)

    def kv_layers(self) -> dict[int, int]:
        return {i: spec.layer for i, spec in self.attention_layers.items()}

    held_drafts = 0                 # draft rows a verify step holds out of the state (make_room_for_drafts)

    def make_room_for_drafts(self, k: int) -> bool:
        """Held-draft arrays in the state for verify steps of up to k drafts (the GPU kernels hold a verify step's
        draft rows there until the sequence's next step applies the accepted ones: gpu_held_drafts.py). False:
        the executor rolls the state back (the numpy one keeps its held drafts apart). Call before the state is
        laid out."""
        self.held_drafts = k
        return False

    def state_layout(self) -> StateLayout | None:
        """Per linear layer: the conv window [conv_kernel - 1, conv_dim] (activation dtype) and the
        recurrent state [Hv, Dk, Dv] (float32); with held drafts (k) their rows too: the conv's inputs
        [k, conv_dim] and the delta rule's [q k v | a | b] rows in two buffers [2, k, conv_dim + 2 Hv]."""
        if not self.linear_specs:
            return None
        s, n, k = next(iter(self.linear_specs.values())), len(self.linear_specs), self.held_drafts
        held = (StateArray("held_conv", n, (k, s.conv_dim), ACTIVATION),
                StateArray("held_delta", n, (2, k, s.conv_dim + 2 * s.num_v_heads), ACTIVATION)) if k else ()
        return StateLayout((StateArray("conv", n, (s.conv_kernel - 1, s.conv_dim), ACTIVATION),
                            StateArray("recurrent", n, (s.num_v_heads, s.k_dim, s.v_dim), "float32")) + held)

    @property
    def activation_width(self) -> int:
        c = self.config
        widths = [2 * c.intermediate_size, c.hidden_size]
        if self.attention_specs:
            widths += [c.q_size + 2 * c.kv_size]
        widths += [s.proj_size + PROJ_ALIGN for s in self.linear_specs.values()]
        return max(widths)

    # ---- checkpoint -> engine layout ----------------------------------------------------------
    def checkpoint(self, has: Callable[[str], bool], get: Callable[[str], Any]
                   ) -> tuple[Callable[[str], bool], Callable[[str], Any]]:
        c = self.config
        perm = None
        if partial_rotary_factor(c) < 1.0:
            perm = rotary_permutation(c.head_dim, rotary_dim(c))

        def source(name: str) -> str:
            base = name.split("#")[0]
            return self.prefix + base[len("model."):] if base.startswith("model.") else base

        def head_rows(a: np.ndarray) -> np.ndarray:
            """Permute the dims (rows) of every head of a q / k projection or norm."""
            if perm is None:
                return a
            heads = a.reshape(-1, c.head_dim, *a.shape[1:])
            return heads[:, perm].reshape(a.shape)

        def engine_get(name: str) -> np.ndarray:
            if name.endswith(PAD):
                s = self.linear_specs[int(name.split(".")[2])]
                return np.zeros((-s.proj_size % PROJ_ALIGN, c.hidden_size), np.float32)
            a = np.asarray(get(source(name)))
            if name.endswith((QUERY, GATE)):         # [Hq · (query D | gate D), H]
                a = a.reshape(c.num_attention_heads, 2, c.head_dim, -1)[:, int(name.endswith(GATE))]
                a = a.reshape(c.q_size, -1)
                return head_rows(a) if name.endswith(QUERY) else a
            if name.endswith("self_attn.k_proj.weight"):
                a = head_rows(a)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                a = head_rows(a)
            if name.endswith(PLUS_ONE_NORMS) or name in PLUS_ONE_TOP:
                a = np.float32(1.0) + a.astype(np.float32)
            return a

        return (lambda name: name.endswith(PAD) or has(source(name))), engine_get

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, ops: Ops, w: dict[str, Array], ctx: Any) -> Array:
        """Final-normed hidden states [T, H]; writes the full-attention layers' KV and updates the
        linear layers' state slots."""
        eps = self.config.rms_norm_eps
        L = self.config.num_hidden_layers
        residual, normed = ops.embed(w["embed_tokens"], ctx), None
        for i in range(L):
            next_norm = w[f"layers.{i + 1}.input_layernorm"] if i + 1 < L else w["norm"]
            with ops.layer_scope(i):
                if i in self.linear_specs:
                    residual, normed = self._deltanet_block(ops, w, residual, normed, i, ctx, eps)
                else:
                    residual, normed = self._attention_block(ops, w, residual, normed, i, ctx, eps)
                residual, normed = mlp_block(ops, w, residual, normed, i, eps, next_norm)
        if normed is None:
            normed, _ = ops.rms_norm(residual, w["norm"], eps)
        return normed

    def _attention_block(self, ops: Ops, w, residual, normed, i: int, ctx, eps: float, spec: AttentionSpec = None):
        """residual + o_proj(attention(rope(q, k), v) · sigmoid(gate)); spec: the KV's (default layer i's)."""
        if normed is None:
            normed, _ = ops.rms_norm(residual, w[f"layers.{i}.input_layernorm"], eps)
        qkv = ops.linear(normed, w[f"layers.{i}.qkv_proj"])
        gate = ops.linear(normed, w[f"layers.{i}.attn_gate_proj"])
        o = ops.rope_attention(qkv, spec or self.attention_layers[i], ctx, q_norm=w[f"layers.{i}.q_norm"],
                               k_norm=w[f"layers.{i}.k_norm"])
        o = ops.deltanet.sigmoid_gate(o, gate)
        return ops.add_linear_norm(o, w[f"layers.{i}.o_proj"], residual, w[f"layers.{i}.post_attention_layernorm"], eps)

    def _deltanet_block(self, ops: Ops, w, residual, normed, i: int, ctx, eps: float):
        """residual + out_proj(gated_rms_norm(gated_delta_rule(conv(in_proj(x))), z))."""
        spec = self.linear_specs[i]
        proj = ops.norm_linear(residual, w[f"layers.{i}.input_layernorm"], eps, w[f"layers.{i}.in_proj"],
                               normed=normed)
        x = ops.deltanet.causal_conv1d(proj, w[f"layers.{i}.conv1d"], spec, ctx)
        o = ops.deltanet.gated_delta_rule(x, proj, w[f"layers.{i}.A_log"], w[f"layers.{i}.dt_bias"], spec, ctx)
        o = ops.deltanet.gated_rms_norm(o, proj, w[f"layers.{i}.linear_norm"], spec)
        post_norm = w[f"layers.{i}.post_attention_layernorm"]
        return ops.add_linear_norm(o, w[f"layers.{i}.out_proj"], residual, post_norm, eps)

    # ---- the multi-token-prediction module (engine/mtp.py) ----------------------------------------------------
    def mtp_module(self) -> MtpModule:
        count = int(self.config.raw.get("mtp_num_hidden_layers") or 0)
        return MtpModule(count=count, count_key="mtp_num_hidden_layers", marker="mtp.fc.weight", head_norm=False,
                         masks_first=False)

    def mtp_weight_specs(self, layer: int, has: Callable[[str], bool]) -> list[WeightSpec]:
        """mtp.layers.0 as engine layer `layer` (gated full attention, dense MLP), the module's norms and fc, and
        the target's lm_head as mtp.head."""
        c = self.config
        H, V, hf = c.hidden_size, c.vocab_size, "mtp.layers.0"
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        return [packed(f"layers.{layer}.input_layernorm", (f"{hf}.input_layernorm.weight", (H,))),
                *self._attention_weights(layer, hf), *self._mlp_weights(layer, hf),
                packed("mtp.enorm", ("mtp.pre_fc_norm_embedding.weight", (H,))),
                packed("mtp.hnorm", ("mtp.pre_fc_norm_hidden.weight", (H,))),
                packed("mtp.eh_proj", ("mtp.fc.weight", (H, 2 * H))),
                packed("mtp.norm", ("mtp.norm.weight", (H,))), packed("mtp.head", (head, (V, H)))]

    def mtp_block(self, ops: Ops, w: dict[str, Array], x: Array, layer: int, ctx: Any) -> Array:
        """The module's layer (gated attention over its own KV, the MLP), then mtp.norm: h', normed."""
        eps = self.config.rms_norm_eps
        spec = replace(next(iter(self.attention_layers.values())), layer=layer)
        residual, normed = self._attention_block(ops, w, x, None, layer, ctx, eps, spec)
        residual, normed = mlp_block(ops, w, residual, normed, layer, eps, w["mtp.norm"])
        return normed if normed is not None else ops.rms_norm(residual, w["mtp.norm"], eps)[0]


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The composite checkpoint: the same text model under model.language_model.*."""
    model_type = "qwen3_5"
    prefix = "model.language_model."

    @staticmethod
    def config_fields(d: dict[str, Any]) -> dict[str, Any]:
        return text_model_fields(d)
