"""DeepSeek-V4 (deepseek_v4, transformers' DeepseekV4ForCausalLM), on the numpy executor and on the GPU
(engine/executor/gpu_dsv4_ops.py: the same functions on CuPy arrays and the line's raw CUDA kernels; decode steps
from the step's device arrays alone, captured in CUDA graphs as the other lines' are).

Residual: hc_mult streams per token (manifold-constrained hyper-connections): each block's input is the
streams collapsed by the `pre` weights of a hyper-connection, its output is spread back by `post` and the streams
mixed by the Sinkhorn-projected `comb` matrix (cpu_dsv4_ops.hyper_connection / hc_merge); the final hyper head
collapses them before the last norm.

Attention (DSV4AttentionSpec, engine/executor/cpu_dsv4_attention.py): q LoRA (wq_a, q_norm, wq_b, a weightless
RMSNorm per head), one shared K = V head of head_dim (wkv, its norm), interleaved rope on each head's trailing
rope dims ("main" theta for sliding layers, "compress" theta (and yarn) for the others), a sliding window, a
learned sink per head, the rope undone on the output, the grouped output projection (wo_a per group, wo_b).
Compressed layers add entries of m tokens each: heavily compressed (HCA, m = 128 on V4) every closed window of
the sequence; compressed sparse (CSA, m = 4, windows overlapping their predecessor) only the index_topk that
the lightning indexer picks per query.

MLP: every layer routed: the first ones by hash (experts from a frozen token-id table, ffn.gate.tid2eid), the
others by sqrtsoftplus scores + the correction bias; weights renormalized, times routed_scaling_factor;
SwiGLU with gate <= swiglu_limit and |up| <= swiglu_limit in the experts and the one shared expert.

KV (kv_layout, state_layout): a compact cache. The paged row of a token and layer (`row_width` values) holds
its roped K = V and, on a compressed layer, the entry of the window the token closes (and, CSA, that window's
indexer key), read only at closing tokens' rows (cpu_dsv4_attention.entry_columns): computed once, never rebuilt.
The compressor's and the indexer's raw inputs (kv and gate projections) are needed only until the windows that read
them close: they live in a per-sequence ring (a state slot: "csa_ring" and "hca_ring", the last rate · series
tokens of each compressed layer). A prefix hit restores the K rows and the entries of the windows closed before it,
not the ring: the sequence replays its last `replay_tokens(hit)` cached tokens (the open window and, CSA, the one
before it), which rebuild the ring but write no row and close no window already stored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM, LayerOptions
from engine.models.moe import EXPERT_WEIGHTS, ExpertShape
from engine.models.ops import Array, RouteSpec
from engine.models.rope import rope_inv_freq
from engine.models.weights import WeightSpec, packed, stacked
from memory.kv_pool import KVLayout
from memory.state_slots import ACTIVATION, StateArray, StateLayout

RATES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
RINGS = ("csa_ring", "hca_ring")        # the state arrays of the CSA and the HCA layers' compressor rings


@dataclass(frozen=True)
class DSV4AttentionSpec:
    """One DeepSeek-V4 attention layer. rate: tokens per compressed entry (0: sliding only); overlap: CSA's
    windows (entry w also reads window w - 1); index_*: the lightning indexer (CSA); ring: the state array of its
    compressor ring ("" on sliding layers), ring_index: the layer's index in it; draft_rows: the ring's rows
    beyond the windows' reach, for the draft tokens a verify step may store past the accepted ones."""
    layer: int
    num_heads: int
    head_dim: int
    rope_dim: int
    window: int
    rate: int
    overlap: bool
    index_heads: int
    index_dim: int
    index_topk: int
    o_groups: int
    rms_eps: float
    inv_freq: Any                      # float32 [rope_dim / 2] of this layer's rope ("main" or "compress")
    compress_inv_freq: Any             # the compressed entries' and the indexer's
    ring: str = ""
    ring_index: int = 0
    draft_rows: int = 0

    @property
    def series(self) -> int:
        """Compressed series per token: 2 with overlapping windows (Ca for the next entry, Cb for its own)."""
        return 2 if self.overlap else 1

    @property
    def row_width(self) -> int:
        """Values per token in the paged cache: K = V, then (compressed layers) the entry of the window the token
        closes, then (CSA) that window's indexer key."""
        return self.head_dim + (self.head_dim if self.rate else 0) + (self.index_dim if self.index_heads else 0)

    @property
    def ring_len(self) -> int:
        """Tokens the compressor ring keeps: the windows still open at a step's end read at most rate · series;
        with draft_rows more, a verify step's rejected drafts (stored at their positions modulo ring_len)
        overwrite only rows older than any window of the accepted tokens reads."""
        return self.rate * self.series + self.draft_rows

    @property
    def ring_width(self) -> int:
        """Values per token in the ring: the compressor's kv | gate (series · head_dim each), then (CSA) the
        indexer's kv | gate (2 · index_dim each)."""
        return ((2 * self.series * self.head_dim if self.rate else 0)
                + (2 * 2 * self.index_dim if self.index_heads else 0))


@dataclass(frozen=True)
class DeepseekV4Config:
    """The DeepSeek-V4 fields of a config.json beyond ModelConfig's."""
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    rates: tuple[int, ...]
    index_heads: int
    index_dim: int
    index_topk: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    experts: int
    top_k: int
    moe_inter: int
    scale: float
    swiglu_limit: float
    scoring: str
    compress_rope_theta: float
    compress_scaling: dict | None

    @classmethod
    def from_raw(cls, raw: dict[str, Any], layers: int) -> "DeepseekV4Config":
        if int(raw.get("num_key_value_heads") or 1) != 1:
            raise ValueError("deepseek_v4: one shared KV head (num_key_value_heads=1) is the only form")
        if raw.get("scoring_func", "sqrtsoftplus") not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"deepseek_v4: unsupported scoring_func {raw.get('scoring_func')!r}")
        if raw.get("norm_topk_prob") is False or raw.get("mlp_bias") or raw.get("attention_bias"):
            raise ValueError("deepseek_v4: norm_topk_prob=false, mlp_bias or attention_bias are not supported")
        head_dim = int(raw.get("head_dim") or 512)
        factor = raw.get("partial_rotary_factor") or int(raw.get("qk_rope_head_dim") or 64) / head_dim
        types = tuple(raw.get("layer_types") or ())
        if len(types) != layers or any(t not in RATES for t in types):
            raise ValueError(f"deepseek_v4: layer_types must name one of {sorted(RATES)} per layer, got {types}")
        mlp = tuple(raw.get("mlp_layer_types") or ["hash_moe"] * min(layers, 3) + ["moe"] * max(0, layers - 3))
        rates = {**{k: v for k, v in RATES.items() if v}, **(raw.get("compress_rates") or {})}
        rope = raw.get("rope_parameters") or {}
        compress = dict(rope.get("compress") or {})
        scaling = compress if compress.get("rope_type", "default") != "default" else None
        return cls(head_dim=head_dim, rope_dim=int(head_dim * factor), q_lora_rank=int(raw["q_lora_rank"]),
                   o_groups=int(raw["o_groups"]), o_lora_rank=int(raw["o_lora_rank"]),
                   window=int(raw["sliding_window"]), layer_types=types, mlp_layer_types=mlp,
                   rates=tuple(int(rates.get(t, 0)) for t in types), index_heads=int(raw["index_n_heads"]),
                   index_dim=int(raw["index_head_dim"]), index_topk=int(raw["index_topk"]),
                   hc_mult=int(raw["hc_mult"]), hc_iters=int(raw["hc_sinkhorn_iters"]), hc_eps=float(raw["hc_eps"]),
                   experts=int(raw["n_routed_experts"]), top_k=int(raw["num_experts_per_tok"]),
                   moe_inter=int(raw["moe_intermediate_size"]), scale=float(raw.get("routed_scaling_factor", 1.0)),
                   swiglu_limit=float(raw.get("swiglu_limit") or 0.0) or float("inf"),
                   scoring=raw.get("scoring_func", "sqrtsoftplus"),
                   compress_rope_theta=float(compress.get("rope_theta") or raw.get("compress_rope_theta") or 160000.0),
                   compress_scaling=scaling)

    @property
    def route(self) -> RouteSpec:
        return RouteSpec(num_experts=self.experts, top_k=self.top_k, renormalize=True, scale=self.scale,
                         scoring=self.scoring)


class DeepseekV4ForCausalLM(DecoderLM):
    model_type = "deepseek_v4"
    cuda_graphs = True          # decode: gpu_dsv4_ops.device_attention, no host reads
    graph_temporaries = True    # its ops' float32 temporaries: drawn from the graphs' own pool
    op_families = frozenset({"moe", "dsv4"})
    fp8_kv_cache = False        # its rows (K, entries, indexer keys) are read and written as float32 / bf16
    kept_experts = EXPERT_WEIGHTS

    @staticmethod
    def config_fields(d: dict[str, Any]) -> dict[str, Any]:
        if "intermediate_size" not in d:                 # transformers' alias of it
            d = {**d, "intermediate_size": d.get("moe_intermediate_size")}
        return d

    def __init__(self, config: ModelConfig):
        self.config, self.opt = config, LayerOptions()
        self.v4 = m = DeepseekV4Config.from_raw(config.raw, config.num_hidden_layers)
        main = rope_inv_freq(dataclasses.replace(config, rope_scaling=None), m.rope_dim)[0]
        compress = rope_inv_freq(dataclasses.replace(config, rope_theta=m.compress_rope_theta,
                                                     rope_scaling=m.compress_scaling), m.rope_dim)[0]
        csa = [t == "compressed_sparse_attention" for t in m.layer_types]
        rings = [RINGS[not csa[i]] if m.rates[i] else "" for i in range(config.num_hidden_layers)]
        self.attention_specs = [
            DSV4AttentionSpec(layer=i, num_heads=config.num_attention_heads, head_dim=m.head_dim, rope_dim=m.rope_dim,
                              window=m.window, rate=m.rates[i], overlap=csa[i],
                              index_heads=m.index_heads if csa[i] else 0,
                              index_dim=m.index_dim, index_topk=m.index_topk, o_groups=m.o_groups,
                              rms_eps=config.rms_norm_eps, inv_freq=compress if m.rates[i] else main,
                              compress_inv_freq=compress, ring=rings[i], ring_index=rings[:i].count(rings[i]))
            for i in range(config.num_hidden_layers)]

    def layer_weight_specs(self, i: int) -> list[WeightSpec]:
        c, m, s = self.config, self.v4, self.attention_specs[i]
        H, D, N, hf, L = c.hidden_size, m.head_dim, m.hc_mult, f"model.layers.{i}", f"layers.{i}."
        at = f"{hf}.attn"
        hc = (2 + N) * N
        specs = [packed(L + "input_layernorm", (f"{hf}.attn_norm.weight", (H,))),
                 packed(L + "post_attention_layernorm", (f"{hf}.ffn_norm.weight", (H,)))]
        for site in ("attn", "ffn"):
            specs += [packed(f"{L}hc_{site}_fn", (f"{hf}.hc_{site}_fn", (hc, N * H))),
                      packed(f"{L}hc_{site}_base", (f"{hf}.hc_{site}_base", (hc,))),
                      packed(f"{L}hc_{site}_scale", (f"{hf}.hc_{site}_scale", (3,)))]
        heads = c.num_attention_heads
        specs += [packed(L + "wq_a", (f"{at}.wq_a.weight", (m.q_lora_rank, H))),
                  packed(L + "q_norm", (f"{at}.q_norm.weight", (m.q_lora_rank,))),
                  packed(L + "wq_b", (f"{at}.wq_b.weight", (heads * D, m.q_lora_rank))),
                  packed(L + "wkv", (f"{at}.wkv.weight", (D, H))),
                  packed(L + "kv_norm", (f"{at}.norm.weight", (D,))),
                  packed(L + "wo_a", (f"{at}.wo_a.weight", (m.o_groups * m.o_lora_rank, heads * D // m.o_groups))),
                  packed(L + "wo_b", (f"{at}.wo_b.weight", (H, m.o_groups * m.o_lora_rank))),
                  packed(L + "sinks", (f"{at}.attn_sink", (heads,)))]
        for name, ckpt, width, on in (("comp_", f"{at}.compressor", s.series * D, s.rate),
                                      ("idx_comp_", f"{at}.indexer.compressor", 2 * m.index_dim, s.index_heads)):
            if on:
                specs += [packed(L + name + "wkv", (f"{ckpt}.wkv.weight", (width, H))),
                          packed(L + name + "wgate", (f"{ckpt}.wgate.weight", (width, H))),
                          packed(L + name + "ape", (f"{ckpt}.ape", (s.rate, width))),
                          packed(L + name + "norm", (f"{ckpt}.norm.weight", (width // s.series if name == "comp_"
                                                                              else m.index_dim,)))]
        if s.index_heads:
            iq = m.index_heads * m.index_dim
            specs += [packed(L + "idx_wq_b", (f"{at}.indexer.wq_b.weight", (iq, m.q_lora_rank))),
                      packed(L + "idx_weights", (f"{at}.indexer.weights_proj.weight", (m.index_heads, H)))]
        ffn, E, I = f"{hf}.ffn", m.experts, m.moe_inter
        specs += [packed(L + "router", (f"{ffn}.gate.weight", (E, H))),
                  stacked(L + "experts_gate_up_proj", [[(f"{ffn}.experts.{e}.w1.weight", (I, H)),
                                                        (f"{ffn}.experts.{e}.w3.weight", (I, H))] for e in range(E)]),
                  stacked(L + "experts_down_proj", [[(f"{ffn}.experts.{e}.w2.weight", (H, I))] for e in range(E)]),
                  packed(L + "shared_gate_up_proj", (f"{ffn}.shared_experts.w1.weight", (I, H)),
                         (f"{ffn}.shared_experts.w3.weight", (I, H))),
                  packed(L + "shared_down_proj", (f"{ffn}.shared_experts.w2.weight", (H, I)))]
        if m.mlp_layer_types[i] == "hash_moe":
            specs.append(packed(L + "tid2eid", (f"{ffn}.gate.tid2eid", (c.vocab_size, m.top_k))))
        else:
            specs.append(packed(L + "router_bias", (f"{ffn}.gate.bias", (E,))))
        return specs

    def weight_specs(self) -> list[WeightSpec]:
        c, N, H = self.config, self.v4.hc_mult, self.config.hidden_size
        specs = [packed("embed_tokens", ("model.embed_tokens.weight", (c.vocab_size, H)))]
        for i in range(c.num_hidden_layers):
            specs += self.layer_weight_specs(i)
        return specs + [packed("norm", ("model.norm.weight", (H,))),
                        packed("hc_head_fn", ("model.hc_head.hc_fn", (N, N * H))),
                        packed("hc_head_base", ("model.hc_head.hc_base", (N,))),
                        packed("hc_head_scale", ("model.hc_head.hc_scale", (1,))),
                        packed("lm_head", ("head.weight", (c.vocab_size, H)))]

    @property
    def expert_shape(self) -> ExpertShape:
        c = self.config
        return ExpertShape(num_experts=self.v4.experts, top_k=self.v4.top_k, hidden=c.hidden_size,
                           inter=self.v4.moe_inter)

    @property
    def activation_width(self) -> int:
        """The executor's activation buffers hold the hidden rows and the shared expert's gate_up (the
        attention's and hyper-connections' float32 arrays are the GPU ops' own)."""
        return max(self.config.hidden_size, 2 * self.v4.moe_inter)

    def check_gpu_shapes(self) -> None:
        """The GPU's limits for this line, refused at start (its attention is not the paged kernels')."""
        c, m = self.config, self.v4
        if c.hidden_size % 8 or m.moe_inter % 8:
            raise ValueError(f"deepseek_v4 on the GPU: hidden ({c.hidden_size}) and moe_intermediate_size "
                             f"({m.moe_inter}) must be multiples of 8")
        if not 1 <= m.hc_mult <= 5:
            raise ValueError(f"deepseek_v4 on the GPU: the hyper-connection kernels (dsv4_hc.cu) hold the comb matrix "
                             f"in one warp, hc_mult 1..5; this model has {m.hc_mult}")
        if m.head_dim > 1024 or m.head_dim % 4 or m.index_dim % 4 or m.index_heads * m.index_dim > 8192:
            raise ValueError(f"deepseek_v4 on the GPU: the compressor (dsv4_compress.cu) holds an entry of at most "
                             f"1024 values, the indexer (dsv4_indexer.cu) a query of at most 8192 and reads its keys "
                             f"4 values at a time: head_dim {m.head_dim} (at most 1024) and index_head_dim "
                             f"{m.index_dim} must be multiples of 4, index_n_heads · index_head_dim "
                             f"{m.index_heads * m.index_dim} at most 8192")
        if "hash_moe" in m.mlp_layer_types and m.experts > 256:
            raise ValueError(f"deepseek_v4 on the GPU: hash-routed layers hold tid2eid as bf16, exact for expert "
                             f"ids below 256; this model has {m.experts} experts")

    def kv_layout(self) -> KVLayout:
        return KVLayout(layers=self.config.num_hidden_layers, planes=1, heads=1,
                        dim=max(s.row_width for s in self.attention_specs))

    def state_layout(self) -> StateLayout | None:
        """The compressor rings: per compressed layer type ("csa_ring", "hca_ring"), each of its layers' last
        ring_len tokens' compressor inputs [ring_len, ring_width] (activation dtype); None without a compressed
        layer. The input of position p of the sequence in slot s: state[ring][ring_index, s, p % ring_len]."""
        arrays = []
        for name in RINGS:
            specs = [s for s in self.attention_specs if s.ring == name and s.rate]
            if specs:
                layers = 1 + max(s.ring_index for s in specs)
                arrays.append(StateArray(name, layers, (specs[0].ring_len, specs[0].ring_width), ACTIVATION))
        return StateLayout(tuple(arrays)) if arrays else None

    def make_room_for_drafts(self, k: int) -> bool:
        """Rings sized for verify steps of up to k draft tokens (DSV4AttentionSpec.draft_rows): what a rejected
        draft stores there (its inputs, at a row no accepted window reads) and in the KV rows of its position (its
        K and any entry it closes, written again when the sequence reaches that position) is never read, so no
        rollback is needed. Call before the state is laid out."""
        self.attention_specs = [dataclasses.replace(s, draft_rows=k if s.rate else 0) for s in self.attention_specs]
        return True

    def replay_tokens(self, hit: int) -> int:
        """The cached tokens a prefix hit of `hit` tokens recomputes to rebuild the rings: on each compressed
        layer the window still open at the hit and, with overlap, the one before it (whose first series the next
        entry reads); their K rows and the closed windows' entries stay the restored blocks'."""
        return min(hit, max((hit % s.rate + (s.rate if s.overlap else 0) for s in self.attention_specs if s.rate),
                            default=0))

    @property
    def rope_dim(self) -> int:
        return self.v4.rope_dim

    def moe(self, ops, w: dict[str, Array], x: Array, i: int, ctx: Any) -> Array:
        """The shared expert plus the routed experts (hash- or score-routed) of layer i on x."""
        L, limit = f"layers.{i}.", self.v4.swiglu_limit
        shared = ops.linear(ops.dsv4.swiglu_limited(ops.linear(x, w[L + "shared_gate_up_proj"]), limit),
                            w[L + "shared_down_proj"])
        if L + "tid2eid" in w:
            weights, ids = ops.dsv4.hash_route(x, w[L + "router"], w[L + "tid2eid"], self.v4.route, ctx)
        else:
            weights, ids = ops.moe.route(x, w[L + "router"], self.v4.route, w[L + "router_bias"])
        return ops.moe.experts(x, w[L + "experts_gate_up_proj"], w[L + "experts_down_proj"], weights, ids, shared,
                               limit=limit)

    def check_drafts(self, batch) -> None:
        """A verify step's drafts must fit the rings' draft rows (make_room_for_drafts): more would overwrite ring
        rows the accepted windows read (ValueError, not a wrong answer)."""
        rooms = [s.draft_rows for s in self.attention_specs if s.rate]
        drafts = max((s.num_drafts for s in batch.seqs), default=0) if batch is not None else 0
        if rooms and drafts > (room := min(rooms)):
            raise ValueError(f"deepseek_v4: a verify step with {drafts} draft tokens a sequence, but the compressor "
                             f"rings hold room for {room} (the executor's num_speculative_tokens)")

    def forward(self, ops, w: dict[str, Array], ctx: Any) -> Array:
        c, m = self.config, self.v4
        eps, hc = c.rms_norm_eps, (m.hc_iters, m.hc_eps, c.rms_norm_eps)
        v4 = ops.dsv4
        self.check_drafts(getattr(ctx, "batch", None))
        streams = v4.hc_streams(ops.embed(w["embed_tokens"], ctx), m.hc_mult)
        for spec in self.attention_specs:
            L = f"layers.{spec.layer}."
            post, comb, x = v4.hyper_connection(streams, w[L + "hc_attn_fn"], w[L + "hc_attn_base"],
                                                w[L + "hc_attn_scale"], *hc)
            out = v4.attention(ops.rms_norm(x, w[L + "input_layernorm"], eps)[0], w, spec, ctx)
            streams = v4.hc_merge(out, streams, post, comb)
            post, comb, x = v4.hyper_connection(streams, w[L + "hc_ffn_fn"], w[L + "hc_ffn_base"],
                                                w[L + "hc_ffn_scale"], *hc)
            out = self.moe(ops, w, ops.rms_norm(x, w[L + "post_attention_layernorm"], eps)[0], spec.layer, ctx)
            streams = v4.hc_merge(out, streams, post, comb)
        x = v4.hyper_head(streams, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], m.hc_eps, eps)
        return ops.rms_norm(x, w["norm"], eps)[0]
