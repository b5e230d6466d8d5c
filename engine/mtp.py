"""Multi-token-prediction layers (vLLM's `mtp` speculative method, alias `deepseek_mtp`): DeepSeek-V3 / Kimi-K2's
MTP module, read from the target's own folder at start.

The layout (DeepSeek-V3's README_WEIGHTS.md; vLLM's deepseek_mtp.py), L = num_hidden_layers, one module per
num_nextn_predict_layers at model.layers.{L}, {L + 1}, ...:

  enorm.weight [H], hnorm.weight [H]          RMSNorms of the next token's embedding and of the target's hidden
  eh_proj.weight [H, 2 H]                     over concat(enorm(embedding), hnorm(hidden))
  input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
                                              one decoder block of the target's kind at index L (MLA; MoE when
                                              L >= first_k_dense_replace, else dense)
  shared_head.norm.weight [H], shared_head.head.weight [V, H]
                                              its final norm and lm_head (the target's lm_head where absent)
  embed_tokens.weight [V, H]                  a copy of the target's embedding (the target's is used)

At position i: h' = Block(eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))), logits =
shared_head.head(shared_head.norm(h')), h_i the target's last hidden state (before its final norm). The block's
weights load as the target's layer L would (layer_weight_specs), through the same loaders (FP8 block scales,
int4 dequantized to float32 here).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from engine.loader.hf import read_weights
from engine.loader.safetensors_io import SafetensorsCheckpoint
from engine.model_files import ModelLoadError
from engine.models.decoder import DecoderLM
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.weights import packed

log = logging.getLogger(__name__)

MTP_NAMES = ("enorm", "hnorm", "eh_proj", "norm", "head")      # the module's own weights: mtp.{name}


@dataclass
class MtpLayer:
    layer: int                          # its block's layer index (the target's num_hidden_layers)
    weights: dict[str, np.ndarray]      # layers.{layer}.* as the target's layer would load, and mtp.{MTP_NAMES}


def mtp_weight_specs(model: DeepseekV3ForCausalLM, layer: int, has_head: bool) -> list:
    """The engine weights of the MTP module at model.layers.{layer}: its block's as the target's layer `layer`
    would be, and its norms, projection and head (mtp.head from lm_head where the module ships none)."""
    H, V = model.config.hidden_size, model.config.vocab_size
    hf = f"model.layers.{layer}"
    head = (f"{hf}.shared_head.head.weight", (V, H)) if has_head else ("lm_head.weight", (V, H))
    return model.layer_weight_specs(layer) + [
        packed("mtp.enorm", (f"{hf}.enorm.weight", (H,))), packed("mtp.hnorm", (f"{hf}.hnorm.weight", (H,))),
        packed("mtp.eh_proj", (f"{hf}.eh_proj.weight", (H, 2 * H))),
        packed("mtp.norm", (f"{hf}.shared_head.norm.weight", (H,))), packed("mtp.head", head)]


def load_mtp_layer(folder: str, model: DecoderLM) -> MtpLayer:
    """The first MTP module of the target in `folder`; ValueError for a line that has none, ModelLoadError for a
    checkpoint without one or whose tensors do not fit."""
    if not isinstance(model, DeepseekV3ForCausalLM):
        raise ValueError(f"--speculative-config: method 'mtp' runs DeepSeek-V3 / Kimi-K2's multi-token-prediction "
                         f"layers; this model is {model.model_type!r}, which the engine runs no MTP layers of")
    L, count = model.config.num_hidden_layers, model.mla.mtp_layers
    ckpt = SafetensorsCheckpoint(folder)
    if not count or f"model.layers.{L}.eh_proj.weight" not in ckpt:
        raise ModelLoadError(f"--speculative-config: method 'mtp': {folder} has no multi-token-prediction layer "
                             f"(num_nextn_predict_layers = {count}; model.layers.{L}.eh_proj.weight "
                             f"{'present' if f'model.layers.{L}.eh_proj.weight' in ckpt else 'absent'})")
    try:
        weights = read_weights(ckpt, model, lambda has: mtp_weight_specs(
            model, L, has(f"model.layers.{L}.shared_head.head.weight")), np.float32, folder)
    except ValueError as e:        # a tensor missing (ModelLoadError), or not of its layout shape
        raise ModelLoadError(f"--speculative-config: method 'mtp': {e.args[0]}") from None
    if count > 1:
        log.info("mtp: %d MTP layers in the checkpoint; the first (model.layers.%d) drafts every token, applied "
                 "recursively as vLLM does", count, L)
    return MtpLayer(layer=L, weights=weights)
