"""ModelConfig: the hyper-parameters of one model, parsed from a Hugging Face `config.json`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from engine.model_files import ModelLoadError, read_json_object
from engine.models.registry import model_class
# Sizes that must be positive integers: the required ones, and those that may be left out (or null).
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def _positive(d: dict[str, Any], key: str) -> int:
    """d[key] as a positive int; ValueError naming the field otherwise (0, negatives, 1.5, "abc", true)."""
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    torch_dtype: str = "bfloat16"
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type")
        d = model_class(model_type).config_fields(d)
        for key in REQUIRED_SIZES:
            if key not in d:
                raise ValueError(f"config.json ({model_type}) is missing {key!r}")
        dims = {key: _positive(d, key) for key in REQUIRED_SIZES + OPTIONAL_SIZES
                if key in REQUIRED_SIZES or d.get(key) is not None}
        heads = dims["num_attention_heads"]
        kv_heads = dims.get("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        head_dim = dims.get("head_dim") or dims["hidden_size"] // heads
        if head_dim < 1:
            raise ValueError(f"hidden_size ({dims['hidden_size']}) is smaller than "
                             f"num_attention_heads ({heads}) and no head_dim is given")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        # transformers 5 moved rope_theta / rope_scaling into `rope_parameters`.
        rope_params = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = dict(rope_params)
        theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if d.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true")
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise ValueError("unsupported: sliding-window attention (use_sliding_window=true)")
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        return cls(
            model_type=model_type,
            hidden_size=dims["hidden_size"],
            num_hidden_layers=dims["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=dims["intermediate_size"],
            vocab_size=dims["vocab_size"],
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=dims.get("max_position_embeddings", 4096),
            torch_dtype=str(dtype),
            hidden_act=act,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            raw=dict(d),
        )

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        """`path` is a model folder or its config.json."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model config not found: {path}")
        d = read_json_object(path)
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"{path}: {e}") from None
