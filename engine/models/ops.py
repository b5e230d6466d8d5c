"""The op set a per-model forward is written in. Each executor implements it over its own
arrays (numpy on the CPU, CuPy device arrays on the GPU); a model file composes these ops
and never touches an array library directly, so one forward serves both executors.

Ops are the dense ops every line uses; a line's other ops come in op families, each a part the executor
builds only for the lines that use it (DecoderLM.op_families) and the line calls through its attribute:
`ops.moe` (MoEOps), `ops.mla` (MLAOps), `ops.deltanet` (DeltaNetOps), `ops.dsv4` (DSV4Ops); `ops.lora`
(LoRAOps) is the executor's, present with LoRA slots, and adds adapter deltas where a dense op names a site.

Shapes: T = tokens in the step (flattened over sequences), H = hidden size.
`ctx` is the executor's per-step context (the ModelBatch plus device copies of its arrays).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

Array = Any


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer needs beyond its weights."""
    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    scale: float


@dataclass(frozen=True)
class RouteSpec:
    """A mixture-of-experts router: softmax over num_experts, the top_k (greedy, or within the
    topk_groups of num_groups equal expert groups whose best probability is highest: DeepSeek's
    group-limited routing), renormalized to sum 1 when renormalize (norm_topk_prob), times scale
    (routed_scaling_factor). scoring "sigmoid" (DeepSeek-V3) or "sqrtsoftplus" (V4): those scores instead; with a
    correction bias (route's ``bias``, noaux_tc) the choice (groups by the sum of their top-2, then
    the top_k) is made on scores + bias, the weights taken from the unbiased scores."""
    num_experts: int
    top_k: int
    renormalize: bool = False
    scale: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    scoring: str = "softmax"


@dataclass(frozen=True)
class MLASpec:
    """One multi-head latent attention layer (DeepSeek-V2). Per token the paged cache holds the
    RMSNorm'd latent c [kv_lora_rank] and the rotated rope key [rope_dim], one plane, one head;
    head h's key is [W_UK_h·c, k_rope], its value W_UV_h·c (W_UK_h, W_UV_h: its rows of kv_b_proj).
    q_cols: the query columns of the fused down-projection (q_lora_rank, or heads·(nope + rope))."""
    layer: int
    num_heads: int
    q_cols: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    rms_eps: float
    scale: float

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def head_dim(self) -> int:
        """The key width of the expanded form (nope + rope): what plain attention kernels see."""
        return self.qk_dim


@dataclass(frozen=True)
class LinearAttentionSpec:
    """What one Gated DeltaNet (linear attention) layer needs beyond its weights. `layer` indexes the
    layer axis of the state slots (memory/state_slots.py). Its input projection's row holds
    [q k v (conv_dim) | z (value_size) | b (Hv) | a (Hv)]."""
    layer: int
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    rms_eps: float

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size

    @property
    def z_offset(self) -> int:
        return self.conv_dim

    @property
    def b_offset(self) -> int:
        return self.conv_dim + self.value_size

    @property
    def a_offset(self) -> int:
        return self.b_offset + self.num_v_heads

    @property
    def proj_size(self) -> int:
        return self.a_offset + self.num_v_heads


class MoEOps(Protocol):
    """Mixture of experts (engine/models/moe.py)."""

    def route(self, x: Array, gate_weight: Array, spec: RouteSpec, bias: Array | None = None) -> tuple[Array, Array]:
        """Router of x[T, H] by gate_weight [E, H] in float32 (RouteSpec; bias: float32 [E], the score
        correction bias): (weights float32 [T, top_k], expert ids int32 [T, top_k])."""

    def experts(self, x: Array, gate_up: Array, down: Array, weights: Array, ids: Array, residual: Array,
                limit: float | None = None) -> Array:
        """residual + sum_j weights[t, j] · down[e] · silu_mul(gate_up[e] · x[t]), e = ids[t, j]: the
        routed experts (gate_up [E, 2I, H], down [E, H, I]) added to the residual stream. limit: gate and up
        clamped first (gate <= limit, |up| <= limit: DeepSeek-V4's swiglu_limit)."""


class MLAOps(Protocol):
    """Multi-head latent attention (engine/models/deepseek_v2.py)."""

    def latent_cache(self, y: Array, spec: MLASpec, ctx: Any, kv_norm: Array, q_norm: Array | None = None) -> Array:
        """y[T, q_cols + kv_lora_rank + rope_dim], the fused down-projection: RMSNorm the latent by
        kv_norm, rotate the rope key (interleaved pairs) at ctx positions and write both into the
        paged cache of layer spec.layer at ctx slot_mapping. Returns the query columns [T, q_cols],
        RMSNorm'd by q_norm where given (q_lora_rank set)."""

    def attention(self, q: Array, kv_b: Array, spec: MLASpec, ctx: Any) -> Array:
        """q[T, heads·(nope + rope)]: rotate each head's rope part, then causal attention of each
        sequence's new queries over its latent cache with the keys and values kv_b
        [heads·(nope + v), kv_lora_rank] expands from it. Returns o[T, heads·v]. The executor picks
        the form: absorbed (W_UK folded into q, W_UV after attention over the latent: decode) or
        expanded (K and V built from the latent: prefill)."""

    def latent_attention(self, y: Array, kv_b: Array, spec: MLASpec, ctx: Any, kv_norm: Array) -> Array:
        """attention(latent_cache(y, spec, ctx, kv_norm), kv_b, spec, ctx) where q_lora_rank is unset (y's
        query columns are q): one op, so an executor can do the cache write and W_UK's absorption of q in
        one launch."""


class DeltaNetOps(Protocol):
    """Hybrid lines (Gated DeltaNet + gated attention; engine/models/qwen3_5.py). State lives in the step's
    state slots (ctx); a sequence whose step starts at position 0 starts from zero state."""

    def causal_conv1d(self, proj: Array, weight: Array, spec: LinearAttentionSpec, ctx: Any) -> Array:
        """silu(depthwise causal conv, width conv_kernel, of proj[:, :conv_dim] over each sequence's
        conv state (its previous conv_kernel - 1 inputs) and this step's rows); weight [conv_dim, 1,
        conv_kernel]. Updates the conv state. Returns x[T, conv_dim] = [q | k | v]."""

    def gated_delta_rule(self, x: Array, proj: Array, a_log: Array, dt_bias: Array, spec: LinearAttentionSpec,
                         ctx: Any) -> Array:
        """The gated delta rule over each sequence's recurrent state S [Hv, Dk, Dv] (float32):
        q, k = l2norm(x's q, k) (q also · Dk^-1/2; key head h·Hk/Hv serves value head h),
        beta = sigmoid(b), g = -exp(a_log) · softplus(a + dt_bias) (b, a from proj); per token
        S = e^g S;  S += k (beta (v - Sᵀk))ᵀ;  o = Sᵀ q. Prefill chunks in the chunk-parallel form,
        decode as the one-step recurrence. Updates the state. Returns o[T, Hv·Dv]."""

    def gated_rms_norm(self, x: Array, proj: Array, weight: Array, spec: LinearAttentionSpec) -> Array:
        """Per value head: rmsnorm(x) · weight · silu(z), z from proj. Returns [T, Hv·Dv]."""

    def sigmoid_gate(self, x: Array, gate: Array) -> Array:
        """x · sigmoid(gate) (the gated attention's output gate)."""


class DSV4Ops(Protocol):
    """DeepSeek-V4's own mechanisms (engine/models/deepseek_v4.py; engine/executor/cpu_dsv4_ops.py defines each)."""

    def hc_streams(self, x: Array, n: int) -> Array:
        """The residual streams [T, n, H] of the embedded tokens x [T, H] (n copies)."""

    def hyper_connection(self, streams: Array, fn: Array, base: Array, scale: Array, iters: int, hc_eps: float,
                         norm_eps: float) -> tuple[Array, Array, Array]:
        """streams [T, N, H] -> (post [T, N], comb [T, N, N], the streams collapsed [T, H])."""

    def hc_merge(self, block_out: Array, streams: Array, post: Array, comb: Array) -> Array:
        """The new streams: post_n · block_out + sum_j comb[j, n] · stream_j."""

    def hyper_head(self, streams: Array, fn: Array, base: Array, scale: Array, hc_eps: float,
                   norm_eps: float) -> Array:
        """The final collapse of the streams [T, N, H] -> [T, H]."""

    def swiglu_limited(self, gate_up: Array, limit: float) -> Array:
        """gate_up [T, 2I] -> silu(min(gate, limit)) · clip(up, -limit, limit)."""

    def hash_route(self, x: Array, gate_weight: Array, tid2eid: Array, spec: RouteSpec, ctx: Any
                   ) -> tuple[Array, Array]:
        """(weights, ids): the experts tid2eid[token] of the step's tokens, weighted by their sqrtsoftplus scores."""

    def attention(self, x: Array, w: dict, spec: Any, ctx: Any) -> Array:
        """The attention block of layer spec.layer on x [T, H] (its input norm applied; sliding window and
        compressed entries); writes the step's KV rows. Returns the output projection's [T, H]."""


class LoRAOps(Protocol):
    """LoRA adapters (engine/lora.py): the executor loads them into slots and sets each step's token -> slot
    map; a dense op that names a site (`lora=`, its engine weight name, e.g. "layers.3.qkv_proj") adds the
    step's adapters' deltas there, nothing when the step runs none."""

    def set_slot(self, slot: int, adapter) -> None:
        """Load a LoRAAdapter into a slot (None: empty it)."""

    def add(self, y: Array, x: Array, site: str) -> Array:
        """y + each row's adapter delta at `site`, scaling · (x · Aᵀ) · Bᵀ over every slice of the packed
        projection (rows without an adapter unchanged); may update y in place."""


class Ops(Protocol):
    moe: MoEOps | None              # the op families (None where the served line uses none)
    mla: MLAOps | None
    deltanet: DeltaNetOps | None
    dsv4: DSV4Ops | None
    lora: LoRAOps | None            # with LoRA slots (the executor's max_loras)

    def embed(self, table: Array, ctx: Any) -> Array:
        """x[T, H] = table[input_ids]."""

    def rms_norm(self, x: Array, weight: Array, eps: float, residual: Array | None = None
                 ) -> tuple[Array, Array]:
        """Fused residual add + RMSNorm: r = x + residual (or x); returns (rmsnorm(r) * weight, r)."""

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """y = x · weightᵀ (+ bias); weight is [N, K] as stored in HF checkpoints."""

    def qkv_rope_cache(self, qkv: Array, spec: AttentionSpec, ctx: Any,
                       q_norm: Array | None = None, k_norm: Array | None = None) -> Array:
        """Split qkv[T, (Hq + 2·Hkv)·D] into q, k, v; per-head RMSNorm on q and k when the norm
        weights are given (Qwen3); rotary embedding (neox style) at ctx positions; write k and v
        into the paged KV cache of layer spec.layer at ctx slot_mapping. Returns q[T, Hq, D]."""

    def attention(self, q: Array, spec: AttentionSpec, ctx: Any) -> Array:
        """Causal attention of each sequence's new queries over its whole paged KV
        (context_lens), GQA. Returns o[T, Hq·D]."""

    def silu_mul(self, gate_up: Array) -> Array:
        """gate_up[T, 2I] -> silu(gate) * up, [T, I]."""

    def gather_rows(self, x: Array, rows: Array) -> Array:
        """x[rows]: the rows whose logits are needed."""

    def add(self, x: Array, residual: Array) -> Array:
        """x + residual (the residual stream update)."""

    def logits(self, hidden: Array, weight: Array) -> Array:
        """float32 logits [R, V] of the hidden rows by the lm_head weight [V, H] (linear; a tensor-parallel
        rank's weight holds its vocabulary rows, and its ops gather every rank's: engine/parallel)."""

    # Fused ops (ComposedOps composes them from the ops above; an executor overrides them where one
    # kernel does it, e.g. the GPU's decode GEMV and decode attention). `lora`: the projection's LoRA site.
    def norm_linear(self, x: Array, norm_weight: Array, eps: float, weight: Array,
                    bias: Array | None = None, normed: Array | None = None, lora: str | None = None) -> Array:
        """linear(rmsnorm(x) * norm_weight, weight, bias) (+ the LoRA delta); ``normed``: that norm, already
        computed (by add_linear_norm)."""

    def add_linear(self, x: Array, weight: Array, residual: Array, bias: Array | None = None,
                   lora: str | None = None) -> Array:
        """residual + linear(x, weight, bias) (+ the LoRA delta): the new residual stream (may reuse residual's
        memory)."""

    def add_linear_norm(self, x: Array, weight: Array, residual: Array, norm_weight: Array, eps: float,
                        bias: Array | None = None, lora: str | None = None) -> tuple[Array, Array | None]:
        """(r, rmsnorm(r) * norm_weight) with r = add_linear(x, weight, residual, bias, lora), where one
        kernel can do the norm with the add; else (r, None), the norm left to the next op."""

    def rope_attention(self, qkv: Array, spec: AttentionSpec, ctx: Any,
                       q_norm: Array | None = None, k_norm: Array | None = None) -> Array:
        """attention(qkv_rope_cache(qkv, ...), spec, ctx): o[T, Hq·D], with k and v written to the cache."""

    def qkv_rope_attention(self, x: Array, norm_weight: Array, eps: float, weight: Array, bias: Array | None,
                           spec: AttentionSpec, ctx: Any, normed: Array | None = None, q_norm: Array | None = None,
                           k_norm: Array | None = None, lora: str | None = None) -> Array:
        """rope_attention(norm_linear(x, norm_weight, eps, weight, bias, normed, lora), spec, ctx, q_norm,
        k_norm): a decoder layer's attention from its input (where an executor adds the q/k/v adapter
        delta inside the attention kernel instead of between the two)."""

    def norm_swiglu(self, x: Array, norm_weight: Array, eps: float, gate_up_weight: Array,
                    normed: Array | None = None, lora: str | None = None) -> Array:
        """silu_mul(norm_linear(x, norm_weight, eps, gate_up_weight, normed=normed, lora=lora)): the MLP
        activation [T, I]."""

    def layer_scope(self, layer: int) -> contextlib.AbstractContextManager:
        """Brackets one decoder layer's ops (an NVTX range on the GPU)."""

    def keep_hidden(self, layer: int, x: Array) -> None:
        """x [T, H], the residual stream entering decoder layer `layer`: kept for a draft that reads it (EAGLE-3)
        where the executor asked for that layer; nothing otherwise. (An MTP layer reads the forward's output,
        which the executor hands the keeper as layer draft_rows.FINAL.)"""


class ComposedOps:
    """The fused ops of Ops written as their parts; an executor's ops class derives from this, implements
    the leaf ops and overrides what it fuses. The families: none until the executor builds the served line's."""
    moe: MoEOps | None = None
    mla: MLAOps | None = None
    deltanet: DeltaNetOps | None = None
    dsv4: DSV4Ops | None = None
    lora: LoRAOps | None = None

    # ---- the leaf ops (Ops) an executor's ops class implements -------------------------------------------
    def rms_norm(self, x, weight, eps, residual=None):
        raise NotImplementedError

    def linear(self, x, weight, bias=None):
        raise NotImplementedError

    def add(self, x, residual):
        raise NotImplementedError

    def silu_mul(self, gate_up):
        raise NotImplementedError

    def qkv_rope_cache(self, qkv, spec, ctx, q_norm=None, k_norm=None):
        raise NotImplementedError

    def attention(self, q, spec, ctx):
        raise NotImplementedError

    # ---- the fused ops, composed ---------------------------------------------------------------------------

    def logits(self, hidden, weight):
        return self.linear(hidden, weight)

    def lora_add(self, y, x, site):
        """y + the step's adapter deltas at `site` (y itself without LoRA slots)."""
        return y if self.lora is None else self.lora.add(y, x, site)

    def norm_linear(self, x, norm_weight, eps, weight, bias=None, normed=None, lora=None):
        if normed is None:
            normed, _ = self.rms_norm(x, norm_weight, eps)
        y = self.linear(normed, weight, bias)
        return y if lora is None else self.lora_add(y, normed, lora)

    def add_linear(self, x, weight, residual, bias=None, lora=None):
        y = self.linear(x, weight, bias)
        return self.add(y if lora is None else self.lora_add(y, x, lora), residual)

    def add_linear_norm(self, x, weight, residual, norm_weight, eps, bias=None, lora=None):
        return self.add_linear(x, weight, residual, bias, lora=lora), None

    def rope_attention(self, qkv, spec, ctx, q_norm=None, k_norm=None):
        return self.attention(self.qkv_rope_cache(qkv, spec, ctx, q_norm=q_norm, k_norm=k_norm), spec, ctx)

    def qkv_rope_attention(self, x, norm_weight, eps, weight, bias, spec, ctx, normed=None, q_norm=None, k_norm=None,
                           lora=None):
        qkv = self.norm_linear(x, norm_weight, eps, weight, bias, normed=normed, lora=lora)
        return self.rope_attention(qkv, spec, ctx, q_norm=q_norm, k_norm=k_norm)

    def norm_swiglu(self, x, norm_weight, eps, gate_up_weight, normed=None, lora=None):
        return self.silu_mul(self.norm_linear(x, norm_weight, eps, gate_up_weight, normed=normed, lora=lora))

    def layer_scope(self, layer: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    keeper = None       # a draft's (EAGLE-3, MTP): keeper.keep(layer, x) copies the hidden states it reads

    def keep_hidden(self, layer, x):
        if self.keeper is not None:
            self.keeper.keep(layer, x)
