"""EAGLE-3 draft heads (vLLM's `eagle3` speculative method): the public checkpoint layout, read and checked
against the target at start.

A head is one Llama decoder layer over the target's own hidden states. Its input at position p is
fc(concat of the target's hidden states entering three of its layers at p) with the embedding of the token at
p + 1; its output, through its own final norm and lm_head over a draft vocabulary, proposes the token at p + 2,
and its pre-norm output is the hidden input of its next (autoregressive) step. The layout (EAGLE-3, SpecForge,
vLLM's llama_eagle3.py), H the head's hidden size, Ht the target's, Vd the draft vocabulary:

  config.json   model_type "llama", architectures [...Eagle3...], num_hidden_layers 1, vocab_size (the
                target's), draft_vocab_size, eagle_config {eagle_aux_hidden_state_layer_ids: [3 ids]} (default
                vLLM's (2, L / 2, L - 3) of the target's L layers), target_hidden_size (default H),
                norm_before_residual (default false)
  fc.weight [H, 3 Ht]          midlayer.input_layernorm / hidden_norm / post_attention_layernorm [H]
  midlayer.self_attn.{q,k,v}_proj [.., 2 H] (the normed embedding and the normed hidden, concatenated)
  midlayer.self_attn.o_proj, midlayer.mlp.{gate,up,down}_proj, norm.weight [H], lm_head.weight [Vd, H]
  d2t int64 [Vd] (target id = draft id + d2t[draft id]), t2d bool [V] (unused), embed_tokens.weight [V, H]
  where shipped (else the target's). Names may carry a "model." prefix and "layers.0." for "midlayer.". vLLM's
  speculators form (Eagle3Speculator: the layer's fields under transformer_layer_config, the aux layer ids at
  the top) reads the same.

The target's hidden state "entering layer i" is its residual stream before layer i (vLLM's aux hidden states).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from engine.loader.safetensors_io import SafetensorsCheckpoint
from engine.model_config import ModelConfig
from engine.model_files import ModelLoadError, read_json_object

TARGET_TYPES = ("qwen3", "llama")               # the target lines whose forward keeps the hidden states a head reads
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Eagle3Head:
    config: ModelConfig                  # the head's (one layer)
    aux_layers: tuple[int, int, int]     # target layers whose entering hidden states feed fc, in fc's order
    draft_vocab_size: int
    norm_before_residual: bool
    weights: dict[str, np.ndarray]       # float32: fc, input_layernorm, hidden_norm, qkv_proj, o_proj,
    #  post_attention_layernorm, gate_up_proj, down_proj, norm, lm_head, draft_to_target (int64 target ids),
    #  embed_tokens where shipped


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's aux hidden state layers when the head's config names none."""
    return 2, num_layers // 2, num_layers - 3


def head_layout(cfg: ModelConfig, target_hidden: int, draft_vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an EAGLE-3 head in the public layout (embed_tokens and t2d optional)."""
    H, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    attn = dict(zip(ATTENTION, ((q, 2 * H), (kv, 2 * H), (kv, 2 * H), (H, q))))
    layout = {"fc.weight": (H, 3 * target_hidden), "norm.weight": (H,), "lm_head.weight": (draft_vocab, H),
              "d2t": (draft_vocab,), "t2d": (cfg.vocab_size,), "embed_tokens.weight": (cfg.vocab_size, H)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        layout[f"midlayer.{norm}.weight"] = (H,)
    for name, shape in attn.items():
        layout[f"midlayer.self_attn.{name}.weight"] = shape
    for name, shape in zip(MLP, ((I, H), (I, H), (H, I))):
        layout[f"midlayer.mlp.{name}.weight"] = shape
    return layout


def layout_name(name: str) -> str:
    """A checkpoint tensor's name in head_layout's spelling ("model." dropped, "layers.0." as "midlayer.")."""
    name = name.removeprefix("model.")
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def flat_config(raw: dict) -> dict:
    """vLLM speculators' form of a head's config (architectures ["Eagle3Speculator"]: the layer's fields under
    transformer_layer_config, draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids, ... at the
    top) as one flat dict; a flat config as it is."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return raw
    top = {k: v for k, v in raw.items() if k not in ("transformer_layer_config", "model_type")}
    return {**layer, **top}


def _head_fields(raw: dict, path: str) -> dict:
    """config.json's fields as ModelConfig reads them, or ModelLoadError for a file that is no EAGLE-3 head."""
    archs = raw.get("architectures") or []
    if not any("eagle3" in str(a).lower() for a in archs):
        raise ModelLoadError(f"{path}: architectures {archs} name no EAGLE-3 head (e.g. LlamaForCausalLMEagle3)")
    if raw.get("model_type", "llama") != "llama" or raw.get("num_hidden_layers", 1) != 1:
        raise ModelLoadError(f"{path}: an EAGLE-3 head of one Llama decoder layer is served, got model_type "
                             f"{raw.get('model_type')!r} with {raw.get('num_hidden_layers')} layers")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelLoadError(f"{path}: a head with attention or MLP biases is not served")
    return {**raw, "model_type": "llama", "num_hidden_layers": 1}


def _aux_layers(raw: dict, num_layers: int, path: str) -> tuple[int, int, int]:
    ids = (raw.get("eagle_aux_hidden_state_layer_ids")
           or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    ids = tuple(ids) if ids else default_aux_layers(num_layers)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ModelLoadError(f"{path}: aux hidden state layers {list(ids)} must be 3 layer ids of the target's "
                             f"{num_layers} (set eagle_config.eagle_aux_hidden_state_layer_ids)")
    return ids


def load_eagle3_head(folder: str, target: ModelConfig) -> Eagle3Head:
    """The head in `folder`, its shapes checked against the layout and the target; ModelLoadError saying what
    does not fit, ValueError for a target line no head serves."""
    if target.model_type not in TARGET_TYPES:
        raise ValueError(f"--speculative-config: method 'eagle3' serves {' and '.join(TARGET_TYPES)} targets; "
                         f"this model is {target.model_type!r}")
    if not folder or not os.path.isdir(folder):
        raise ModelLoadError(f"--speculative-config: eagle3's \"model\" {folder!r} is not a folder (an EAGLE-3 "
                             f"head's config.json and safetensors)")
    path = os.path.join(folder, "config.json")
    raw = flat_config(read_json_object(path))
    try:
        cfg = ModelConfig.from_dict(_head_fields(raw, path))
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    target_hidden = raw.get("target_hidden_size") or cfg.hidden_size
    draft_vocab = raw.get("draft_vocab_size") or cfg.vocab_size
    if cfg.vocab_size != target.vocab_size or target_hidden != target.hidden_size:
        raise ModelLoadError(f"{path}: the head is for a target of vocab {cfg.vocab_size}, hidden {target_hidden}; "
                             f"this target has vocab {target.vocab_size}, hidden {target.hidden_size}")
    aux = _aux_layers(raw, target.num_hidden_layers, path)
    tensors = _read_tensors(folder, head_layout(cfg, target_hidden, draft_vocab))
    if "embed_tokens.weight" not in tensors and cfg.hidden_size != target.hidden_size:
        raise ModelLoadError(f"{folder}: no embed_tokens.weight, and the target's embedding ({target.hidden_size} "
                             f"wide) does not fit the head's hidden size {cfg.hidden_size}")
    return Eagle3Head(config=cfg, aux_layers=aux, draft_vocab_size=int(draft_vocab),
                      norm_before_residual=bool(raw.get("norm_before_residual", False)),
                      weights=_engine_weights(tensors, draft_vocab, target.vocab_size, folder))


def _read_tensors(folder: str, layout: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by layout name, every one known and of its layout shape, the required present."""
    ckpt = SafetensorsCheckpoint(folder)
    tensors = {}
    for name in ckpt.keys():
        key = layout_name(name)
        if key not in layout:
            raise ModelLoadError(f"{folder}: tensor {name!r} is not part of an EAGLE-3 head's layout")
        a = ckpt.get(name)
        if tuple(a.shape) != layout[key]:
            raise ModelLoadError(f"{folder}: tensor {name!r} has shape {list(a.shape)}, the layout "
                                 f"{list(layout[key])}")
        tensors[key] = a
    missing = sorted(set(layout) - set(tensors) - {"embed_tokens.weight", "t2d", "d2t"})
    if missing:
        raise ModelLoadError(f"{folder}: the head is missing {', '.join(missing)}")
    return tensors


def _engine_weights(t: dict[str, np.ndarray], draft_vocab: int, vocab: int, folder: str) -> dict[str, np.ndarray]:
    """The head's weights as the draft runs them (float32; q, k, v fused; gate, up fused; d2t as target ids)."""
    f = {k: np.asarray(v, np.float32) for k, v in t.items() if k not in ("d2t", "t2d")}
    m = "midlayer."
    w = {"fc": f["fc.weight"], "norm": f["norm.weight"], "lm_head": f["lm_head.weight"],
         "qkv_proj": np.concatenate([f[f"{m}self_attn.{p}.weight"] for p in ATTENTION[:3]]),
         "o_proj": f[f"{m}self_attn.o_proj.weight"], "down_proj": f[f"{m}mlp.down_proj.weight"],
         "gate_up_proj": np.concatenate([f[f"{m}mlp.gate_proj.weight"], f[f"{m}mlp.up_proj.weight"]])}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[norm] = f[f"{m}{norm}.weight"]
    w = {k: np.asfortranarray(a) if a.ndim == 2 else a for k, a in w.items()}     # `x @ w.T` reads w.T in order
    if "embed_tokens.weight" in f:
        w["embed_tokens"] = f["embed_tokens.weight"]
    ids = np.arange(draft_vocab, dtype=np.int64)
    if "d2t" in t:
        ids = ids + np.asarray(t["d2t"], np.int64)
    elif draft_vocab != vocab:
        raise ModelLoadError(f"{folder}: a draft vocabulary of {draft_vocab} (not the target's {vocab}) needs d2t")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ModelLoadError(f"{folder}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
    w["draft_to_target"] = ids
    return w
