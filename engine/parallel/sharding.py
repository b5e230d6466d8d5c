"""Which weight of a model line splits how across N tensor-parallel ranks, and one rank's shard.

Megatron's layout, derived from the line's weight declarations (`weight_specs()`), each packed weight
split part by part:
  * column-parallel (ROWS of the [N, K] weight): qkv_proj / qkv_bias by heads (q by query heads, k and
    v by KV heads; with fewer KV heads than ranks each KV head is replicated on N / heads ranks, so a
    rank's query heads still read their own KV head), gate_up_proj gate and up each in N equal row
    shares; the lm_head by vocabulary rows (vocab-parallel; of the embedding when tied);
  * row-parallel (COLS): o_proj by query heads, down_proj in N equal column shares; their partial
    products are summed by one all-reduce (the parallel Ops); the o_proj bias is rank 0's (RANK0: the
    other ranks hold zeros, so every rank takes the same code path and issues the same collectives);
  * EXPERTS: the routed experts' stacked weights, E / N whole experts per rank (expert parallelism);
  * replicated: the embedding, the norms, q/k norm and the router.
A weight kept quantized (FP8, int4, kept experts) is split by the same rule, its codes with their scales
(kept_shards.py): a cut that would split a scale block or group is refused at start (check_kept_cuts).
A weight with no rule refuses tensor parallelism at start, so a new weight in a model line cannot be
split wrongly in silence. A rank runs the line built from `shard_config` (its heads, KV heads and
intermediate size), whose paged KV holds its KV heads alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from engine.model_config import ModelConfig
from engine.models.quant_experts import KEPT
from engine.models.quant_linear import Fp8Linear, W4Linear
from engine.models.registry import build_model, model_types_where
from engine.models.weights import WeightSpec
from engine.parallel.kept_shards import Span, check_cuts, experts_of, kept_shard
from memory.packed_weight import PackedWeight

SUPPORTED_TYPES = model_types_where(lambda line: line.tensor_parallel)       # the lines declaring it
REPLICATE, ROWS, COLS, EXPERTS, RANK0 = "replicate", "rows", "cols", "experts", "rank0"
_REPLICATED = ("norm", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "router")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world_size` tensor-parallel ranks."""
    rank: int
    world_size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")


@dataclass(frozen=True)
class Split:
    """How one engine weight splits: kind (REPLICATE, ROWS, COLS, EXPERTS, RANK0: rank 0 keeps it, the
    others hold zeros) and, for ROWS / COLS, each packed part's head count (its rows or columns are
    heads · head_dim); () splits every part in equal shares."""
    kind: str
    heads: tuple[int, ...] = ()


def share(count: int, shard: Shard, replicate: bool = False) -> tuple[int, int]:
    """(first, number) of `count` units (heads, experts, rows) held by a rank: count / N each; with
    `replicate` and fewer units than ranks (GQA's KV heads), the one unit it shares with N / count ranks."""
    n, r = shard.world_size, shard.rank
    if count % n == 0:
        return r * (count // n), count // n
    if replicate and n % count == 0:
        return r // (n // count), 1
    raise ValueError(f"{count} cannot be split over {n} tensor-parallel ranks")


def split_of(name: str, cfg: ModelConfig) -> Split:
    """The rule of engine weight `name` (ValueError: none)."""
    last = name.rsplit(".", 1)[-1]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if name == "lm_head":
        return Split(ROWS)
    if name == "embed_tokens" or last in _REPLICATED:
        return Split(REPLICATE)
    if last in ("qkv_proj", "qkv_bias"):
        return Split(ROWS, (heads, kv, kv))
    if last == "o_proj":
        return Split(COLS, (heads,))
    if last == "o_bias":
        return Split(RANK0)
    if last in ("experts_gate_up_proj", "experts_down_proj"):
        return Split(EXPERTS)
    if last == "gate_up_proj":
        return Split(ROWS)
    if last == "down_proj":
        return Split(COLS)
    raise ValueError(f"tensor parallelism: no sharding rule for weight {name!r}")


def check_tensor_parallel(model, world_size: int) -> None:
    """Refuse (ValueError naming tensor_parallel_size) a model line or a size the sharding cannot serve."""
    cfg = model.config
    what = f"tensor_parallel_size {world_size}"
    if world_size < 1:
        raise ValueError(f"{what}: must be >= 1")
    if world_size == 1:
        return
    if cfg.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"{what}: the {cfg.model_type} line has no tensor-parallel sharding "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    kv = cfg.num_key_value_heads
    experts = model.expert_shape.num_experts if model.expert_shape is not None else world_size
    checks = [(cfg.num_attention_heads % world_size == 0, f"num_attention_heads ({cfg.num_attention_heads})"),
              (kv % world_size == 0 or world_size % kv == 0, f"num_key_value_heads ({kv}), nor is a multiple of it"),
              (cfg.intermediate_size % world_size == 0, f"intermediate_size ({cfg.intermediate_size})"),
              (cfg.vocab_size % world_size == 0, f"vocab_size ({cfg.vocab_size})"),
              (experts % world_size == 0, f"the routed experts ({experts})")]
    for ok, name in checks:
        if not ok:
            raise ValueError(f"{what}: does not divide {name}")
    for spec in model.weight_specs():
        split_of(spec.name, cfg)


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's model line is built from: its query heads, KV heads, intermediate size; the
    lm_head is a weight of its own (the rank's vocabulary rows), never tied."""
    kv = share(cfg.num_key_value_heads, Shard(0, world_size), replicate=True)[1]
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world_size,
                               num_key_value_heads=kv, intermediate_size=cfg.intermediate_size // world_size,
                               tie_word_embeddings=False)


def _parts(w, spec: WeightSpec) -> list:
    """A packed weight's parts: a PackedWeight's own, or row views of a whole array."""
    if isinstance(w, PackedWeight):
        return list(w.parts)
    bounds = np.cumsum([0] + [shape[0] for _, shape in spec.parts])
    return [w[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _span(size: int, heads: int | None, shard: Shard) -> slice:
    """A rank's slice of `size` rows / columns: by heads (size = heads · head_dim), or an equal share."""
    unit = size // heads if heads else 1
    first, count = share(heads or size, shard, replicate=bool(heads))
    return slice(first * unit, (first + count) * unit)


def _part_spans(spec: WeightSpec, split: Split, shard: Shard) -> list[slice]:
    """A ROWS weight's rows held by a rank, one slice per packed part (in the part's own rows)."""
    sizes = [shape[0] for _, shape in spec.parts]
    return [_span(size, h, shard) for size, h in zip(sizes, split.heads or (None,) * len(sizes))]


def _kept_cuts(w, spec: WeightSpec, split: Split, shard: Shard) -> tuple[int, list[Span]]:
    """(axis, spans) of a kept linear weight held by a rank: its rows of every packed part (ROWS, in the joined
    weight's rows) or its columns (COLS)."""
    if split.kind == COLS:
        s = _span(w.shape[1], split.heads[0] if split.heads else None, shard)
        return 1, [(s.start, s.stop)]
    offsets = np.cumsum([0] + [shape[0] for _, shape in spec.parts])
    return 0, [(int(o) + s.start, int(o) + s.stop) for o, s in zip(offsets, _part_spans(spec, split, shard))]


def _shard_kept(w, spec: WeightSpec, split: Split, shard: Shard):
    """A rank's part of a weight kept quantized: its codes with their scales (kept_shards.py), never dequantized."""
    if split.kind == REPLICATE:
        return w
    if split.kind == EXPERTS:
        return experts_of(w, *share(w.shape[0], shard))
    if split.kind not in (ROWS, COLS):
        raise ValueError(f"tensor parallelism: {spec.name} is kept quantized, its rule {split.kind!r} takes "
                         f"dense weights")
    return kept_shard(spec.name, w, *_kept_cuts(w, spec, split, shard))


def shard_weight(w, spec: WeightSpec, split: Split, shard: Shard):
    """A rank's part of one engine weight (views where the source allows; a kept quantized one stays quantized)."""
    if isinstance(w, KEPT):
        return _shard_kept(w, spec, split, shard)
    if split.kind == REPLICATE:
        return w
    if split.kind == RANK0:
        return w if shard.rank == 0 else np.zeros(w.shape, w.dtype)
    if split.kind == EXPERTS:
        first, count = share(w.shape[0], shard)
        return w[first:first + count]
    if split.kind == COLS:
        return w[:, _span(w.shape[1], split.heads[0] if split.heads else None, shard)]
    out = [p[s] for p, s in zip(_parts(w, spec), _part_spans(spec, split, shard))]
    return out[0] if len(out) == 1 else PackedWeight(out)


def check_kept_cuts(loaded, world_size: int) -> None:
    """Refuse at start (ValueError naming the weight and its sizes) a kept linear weight whose rank shards would
    split its scale blocks or groups (kept_shards.py), before any rank is built."""
    cfg = loaded.model.config
    for spec in loaded.model.weight_specs():
        w = loaded.weights.get(spec.name)
        split = split_of(spec.name, cfg)
        if isinstance(w, (Fp8Linear, W4Linear)) and split.kind in (ROWS, COLS):
            for rank in range(world_size):
                check_cuts(spec.name, w, *_kept_cuts(w, spec, split, Shard(rank, world_size)), rank, world_size)


def shard_weights(model, weights: dict, shard: Shard) -> dict:
    """Rank `shard`'s weights of a model line (the full line, `weights` named by its weight_specs)."""
    cfg = model.config
    out = {}
    for spec in model.weight_specs():
        out[spec.name] = shard_weight(weights[spec.name], spec, split_of(spec.name, cfg), shard)
    if cfg.tie_word_embeddings:
        vocab = WeightSpec("lm_head", (("model.embed_tokens.weight", tuple(weights["embed_tokens"].shape)),))
        out["lm_head"] = shard_weight(weights["embed_tokens"], vocab, split_of("lm_head", cfg), shard)
    return out


def expert_range(model, shard: Shard) -> tuple[int, int]:
    """(first, number) of the routed experts on a rank ((0, 0) for a dense line)."""
    if model.expert_shape is None:
        return 0, 0
    return share(model.expert_shape.num_experts, shard)


def shard_model(loaded, shard: Shard):
    """Rank `shard`'s LoadedModel: its config, its model line and its weights (views of `loaded`'s)."""
    check_tensor_parallel(loaded.model, shard.world_size)
    cfg = shard_config(loaded.config, shard.world_size)
    return dataclasses.replace(loaded, config=cfg, model=build_model(cfg),
                               weights=shard_weights(loaded.model, loaded.weights, shard))
