"""Layer helpers shared by the dense decoder-only model lines (Qwen3, Llama, Qwen2).

A model file declares which pieces it has (qkv bias, per-head q/k norm, tied lm_head) through
these helpers and composes its forward from them. Everything here is written in the Ops of
engine/models/ops.py, with no host-side data-dependent control flow, so a GPU executor can
capture it in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from engine.model_config import ModelConfig
from engine.models.ops import Array, AttentionSpec, LinearAttentionSpec, Ops
from engine.models.weights import WeightSpec, packed
from memory.kv_pool import KVLayout
from memory.state_slots import StateLayout


@dataclass(frozen=True)
class LayerOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False          # per-head RMSNorm on q and k before rotary (Qwen3)


# decoder.py's dense blocks' projections (attention_block, mlp_block)
DENSE_LINEARS = (".qkv_proj", ".o_proj", ".gate_up_proj", ".down_proj")


def attention_specs(cfg: ModelConfig) -> list[AttentionSpec]:
    return [AttentionSpec(layer=i, num_heads=cfg.num_attention_heads,
                          num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                          rms_eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5)
            for i in range(cfg.num_hidden_layers)]


def attention_weight_specs(cfg: ModelConfig, i: int, opt: LayerOptions) -> list[WeightSpec]:
    """Layer i's norms and attention weights: fused qkv_proj [(Hq+2Hkv)·D, H], o_proj, biases, q/k norm."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.q_size, cfg.kv_size
    hf = f"model.layers.{i}"
    at = f"{hf}.self_attn"
    specs = [
        packed(f"layers.{i}.input_layernorm", (f"{hf}.input_layernorm.weight", (H,))),
        packed(f"layers.{i}.qkv_proj", (f"{at}.q_proj.weight", (q, H)),
               (f"{at}.k_proj.weight", (kv, H)), (f"{at}.v_proj.weight", (kv, H))),
        packed(f"layers.{i}.o_proj", (f"{at}.o_proj.weight", (H, q))),
        packed(f"layers.{i}.post_attention_layernorm", (f"{hf}.post_attention_layernorm.weight", (H,))),
    ]
    if opt.qkv_bias:
        specs.append(packed(f"layers.{i}.qkv_bias", (f"{at}.q_proj.bias", (q,)),
                            (f"{at}.k_proj.bias", (kv,)), (f"{at}.v_proj.bias", (kv,))))
    if opt.o_bias:
        specs.append(packed(f"layers.{i}.o_bias", (f"{at}.o_proj.bias", (H,))))
    if opt.qk_norm:
        specs.append(packed(f"layers.{i}.q_norm", (f"{at}.q_norm.weight", (D,))))
        specs.append(packed(f"layers.{i}.k_norm", (f"{at}.k_norm.weight", (D,))))
    return specs


def mlp_weight_specs(name: str, hf: str, hidden: int, inter: int) -> list[WeightSpec]:
    """A SwiGLU MLP at checkpoint prefix `hf`: `{name}gate_up_proj` [2I, H] (gate rows, then up) and
    `{name}down_proj` [H, I]."""
    return [packed(f"{name}gate_up_proj", (f"{hf}.gate_proj.weight", (inter, hidden)),
                   (f"{hf}.up_proj.weight", (inter, hidden))),
            packed(f"{name}down_proj", (f"{hf}.down_proj.weight", (hidden, inter)))]


def layer_weight_specs(cfg: ModelConfig, i: int, opt: LayerOptions) -> list[WeightSpec]:
    """Engine weights of dense decoder layer i: attention_weight_specs and the MLP's gate_up / down."""
    return (attention_weight_specs(cfg, i, opt)
            + mlp_weight_specs(f"layers.{i}.", f"model.layers.{i}.mlp", cfg.hidden_size, cfg.intermediate_size))


def model_weight_specs(cfg: ModelConfig, opt: LayerOptions, layer=None) -> list[WeightSpec]:
    """Embedding, every layer (``layer(i)``: its specs; default layer_weight_specs), final norm, and
    lm_head unless tied to the embedding."""
    V, H = cfg.vocab_size, cfg.hidden_size
    layer = layer or (lambda i: layer_weight_specs(cfg, i, opt))
    specs = [packed("embed_tokens", ("model.embed_tokens.weight", (V, H)))]
    for i in range(cfg.num_hidden_layers):
        specs += layer(i)
    specs.append(packed("norm", ("model.norm.weight", (H,))))
    if not cfg.tie_word_embeddings:
        specs.append(packed("lm_head", ("lm_head.weight", (V, H))))
    return specs


def attention_block(ops: Ops, w: dict[str, Array], residual: Array, normed: Array | None, spec: AttentionSpec,
                    ctx: Any, opt: LayerOptions, eps: float) -> tuple[Array, Array | None]:
    """residual + o_proj(attention(rope(qkv_proj(rmsnorm(residual))))), with KV written to the paged cache;
    ``normed``: rmsnorm(residual) where the op before computed it. Returns the new residual and, where
    one kernel did it with the add, its post-attention norm. Each projection names its LoRA site (its
    weight's name): the step's adapters add their deltas there."""
    i = spec.layer
    o = ops.qkv_rope_attention(residual, w[f"layers.{i}.input_layernorm"], eps, w[f"layers.{i}.qkv_proj"],
                               w.get(f"layers.{i}.qkv_bias"), spec, ctx, normed=normed,
                               q_norm=w[f"layers.{i}.q_norm"] if opt.qk_norm else None,
                               k_norm=w[f"layers.{i}.k_norm"] if opt.qk_norm else None, lora=f"layers.{i}.qkv_proj")
    return ops.add_linear_norm(o, w[f"layers.{i}.o_proj"], residual, w[f"layers.{i}.post_attention_layernorm"], eps,
                               w.get(f"layers.{i}.o_bias"), lora=f"layers.{i}.o_proj")


def mlp_block(ops: Ops, w: dict[str, Array], residual: Array, normed: Array | None, i: int, eps: float,
              next_norm: Array, name: str = "") -> tuple[Array, Array | None]:
    """residual + down_proj(silu(gate) * up), gate and up from one GEMM of rmsnorm(residual) (``normed``
    where already computed). Returns the new residual and, where one kernel did it with the add, its
    norm by ``next_norm`` (the next layer's input norm, or the final one). ``name``: the MLP's weight
    prefix (``layers.{i}.{name}gate_up_proj``; DeepSeek's shared experts are "shared_")."""
    act = ops.norm_swiglu(residual, w[f"layers.{i}.post_attention_layernorm"], eps,
                          w[f"layers.{i}.{name}gate_up_proj"], normed=normed, lora=f"layers.{i}.{name}gate_up_proj")
    return ops.add_linear_norm(act, w[f"layers.{i}.{name}down_proj"], residual, next_norm, eps,
                               lora=f"layers.{i}.{name}down_proj")


def decoder_stack(ops: Ops, w: dict[str, Array], ctx: Any, cfg: ModelConfig,
                  specs: list[AttentionSpec], opt: LayerOptions, attention=attention_block,
                  mlp=mlp_block) -> Array:
    """Pre-norm decoder layers over the residual stream (each RMSNorm fused into the linear layer after
    it or into the residual add before it, each residual add into the one before it); returns the
    final-normed hidden [T, H]. ``attention`` and ``mlp``: the blocks of a layer, with the signatures
    of attention_block and mlp_block (a model line with other blocks passes its own)."""
    eps = cfg.rms_norm_eps
    residual, normed = ops.embed(w["embed_tokens"], ctx), None
    for n, spec in enumerate(specs):
        next_norm = w[f"layers.{specs[n + 1].layer}.input_layernorm"] if n + 1 < len(specs) else w["norm"]
        with ops.layer_scope(spec.layer):
            ops.keep_hidden(spec.layer, residual)
            residual, normed = attention(ops, w, residual, normed, spec, ctx, opt, eps)
            residual, normed = mlp(ops, w, residual, normed, spec.layer, eps, next_norm)
    if normed is None:
        normed, _ = ops.rms_norm(residual, w["norm"], eps)
    return normed


def lm_head_weight(cfg: ModelConfig, w: dict[str, Array]) -> Array:
    return w["embed_tokens"] if cfg.tie_word_embeddings else w["lm_head"]


class DecoderLM:
    """What a model line exposes to the loader and the executors. A dense model line says which
    layer pieces it has (`layer_options`, hence its weights) and runs `decoder_stack`; a model
    line with another structure overrides `weight_specs` and `forward`. Its capabilities are declared
    here (the executors read them, never probe for them)."""
    model_type = ""
    expert_shape = None          # moe.ExpertShape of a line with routed experts
    lora = False                 # its projections are LoRA sites (decoder.py's dense blocks): --enable-lora serves it
    # the engine weights (name suffixes) its forward passes only to ops.linear and the fused linear ops, so they
    # may load kept quantized (engine/models/quant_linear.py); () dequantizes every quantized weight at load
    kept_quantized: tuple[str, ...] = ()
    # the stacked expert weights (name suffixes) it passes only to ops.moe.experts, so they may load kept quantized
    # (engine/models/quant_experts.py)
    kept_experts: tuple[str, ...] = ()
    tensor_parallel = False      # engine/parallel/sharding.py knows how to shard its weights
    # layer -> LinearAttentionSpec of the Gated DeltaNet layers (hybrid lines; the GPU checks their shapes)
    linear_specs: Mapping[int, LinearAttentionSpec] = MappingProxyType({})
    gpu_supported = True         # the GPU executor runs the line (False: --device cpu only)
    # the GPU may capture the line's steps as CUDA graphs (its ops allocate nothing and wait on nothing from
    # the host)
    cuda_graphs = True
    # True: the line's ops allocate CuPy temporaries inside a step: its decode graphs are captured with them drawn
    # from a pool of their own (gpu_graphs.capture_memory); False: captured as they are
    graph_temporaries = False
    # True: the forward between two attention calls depends on the step's token count only (no host
    # decision from the data), so the GPU may replay it as piecewise CUDA graphs (gpu_piecewise.py)
    piecewise_graphs = False
    # True: every read of the KV cache is ops.attention / rope_attention of its layer, so a host-tier restore
    # may land layer by layer under the step's forward (GpuHostCopies._restore_by_layer)
    layerwise_restore = False
    # its paged KV may be stored as FP8 e4m3 (--kv-cache-dtype fp8, memory/kv_format.py)
    fp8_kv_cache = True

    def __init__(self, config: ModelConfig):
        self.config = config
        self.opt = self.layer_options(config)
        self.attention_specs = attention_specs(config)

    @staticmethod
    def config_fields(d: dict[str, Any]) -> dict[str, Any]:
        """config.json's fields as ModelConfig reads them; a line whose config nests or renames them (a
        composite's text_config, an alias) maps them here, and refuses settings it cannot serve."""
        return d

    @staticmethod
    def layer_options(config: ModelConfig) -> LayerOptions:
        raise NotImplementedError

    @property
    def op_families(self) -> frozenset[str]:
        """The op families (engine/models/ops.py) the forward calls beyond the dense Ops: "moe" with routed
        experts; a line with others adds its own. The executors build those parts only."""
        return frozenset({"moe"}) if self.expert_shape is not None else frozenset()

    def mtp_module(self):
        """The line's multi-token-prediction module as its checkpoints store it (engine/models/mtp_module.py);
        None: the line has none the engine runs."""
        return None

    def check_gpu_shapes(self) -> None:
        """The GPU kernels' shape limits for this line, refused at start (the GPU executor calls it)."""
        c = self.config
        H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
        Hq, Hkv = c.num_attention_heads, c.num_key_value_heads
        if H % 8 or I % 8 or D % 2 or D > 256 or Hq % Hkv or Hq // Hkv > 16:
            raise ValueError(f"GPU kernels need hidden % 8 == 0 (got {H}), intermediate % 8 == 0 (got {I}), "
                             f"an even head_dim <= 256 (got {D}), heads/kv_heads <= 16 (got {Hq}/{Hkv})")

    def weight_specs(self) -> list[WeightSpec]:
        return model_weight_specs(self.config, self.opt)

    def checkpoint(self, has: Callable[[str], bool], get: Callable[[str], Any]
                   ) -> tuple[Callable[[str], bool], Callable[[str], Any]]:
        """The checkpoint as weight_specs() names it: (has, get) over the checkpoint's own. A line whose
        engine layout differs from its checkpoint's maps names and rearranges tensors here."""
        return has, get

    def state_layout(self) -> StateLayout | None:
        """What one sequence's state slot holds (linear-attention lines); None: no per-sequence state."""
        return None

    def make_room_for_drafts(self, k: int) -> bool:
        """Lay the state out for verify steps of up to k draft tokens; True where the state then needs no
        rollback of rejected drafts (DeepSeek-V4's rings), False where the executor must roll it back."""
        return False

    # replay_tokens(hit): the tokens before a prefix-cache hit of `hit` tokens that a sequence recomputes to
    # rebuild its state slot (their KV stays as restored); None: a hit cannot rebuild this line's state (a line
    # that keeps state then caches no prefixes)
    replay_tokens: Callable[[int], int] | None = None

    def kv_layout(self) -> KVLayout:
        """What one token stores in the paged KV pool: K and V of every layer's KV heads."""
        c = self.config
        return KVLayout(layers=c.num_hidden_layers, planes=2, heads=c.num_key_value_heads, dim=c.head_dim)

    def kv_layers(self) -> dict[int, int]:
        """Decoder layer -> its layer in the paged KV pool (the checkpoint names KV scales by the first)."""
        return {i: i for i in range(self.kv_layout().layers)}

    @property
    def rope_dim(self) -> int:
        """Rotary dimensions per head (the executors' cos / sin tables are [positions, rope_dim / 2])."""
        return self.config.head_dim

    @property
    def activation_width(self) -> int:
        """The widest activation row the forward writes (gate_up, qkv or hidden)."""
        c = self.config
        return max(2 * c.intermediate_size, c.q_size + 2 * c.kv_size, c.hidden_size)

    def forward(self, ops: Ops, w: dict[str, Array], ctx: Any) -> Array:
        """Final-normed hidden states [T, H] for every token of the step; writes the step's KV."""
        return decoder_stack(ops, w, ctx, self.config, self.attention_specs, self.opt)

    def compute_logits(self, ops: Ops, w: dict[str, Array], hidden: Array) -> Array:
        """logits [R, V] for the given hidden rows."""
        return ops.logits(hidden, lm_head_weight(self.config, w))
