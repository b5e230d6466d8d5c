"""Multi-token-prediction layers (vLLM's `mtp` speculative method, aliases deepseek_mtp, qwen3_5_mtp, ...): the
target's own MTP module, read from its folder at start. The lines that ship them declare the module
(engine/models/mtp_module.py):

DeepSeek-V3 / Kimi-K2 (README_WEIGHTS.md; vLLM's deepseek_mtp.py), one module per num_nextn_predict_layers at
model.layers.{L}, {L + 1}, ... (L = num_hidden_layers):
  enorm.weight, hnorm.weight [H]; eh_proj.weight [H, 2 H]; input_layernorm, self_attn.*, post_attention_layernorm,
  mlp.*: a decoder block of the target's kind at index L (MLA; MoE where L >= first_k_dense_replace);
  shared_head.norm.weight [H], shared_head.head.weight [V, H] (the target's lm_head where absent);
  embed_tokens.weight (a copy of the target's: the target's is used).
  h' = Block(eh_proj(concat(enorm(e), hnorm(h_i)))), logits = shared_head.head(shared_head.norm(h')), with
  e = embed(t_{i+1}) and e = 0 at position 0 (vLLM masks it there).
Qwen3.5 (vLLM's qwen3_5_mtp.py), mtp_num_hidden_layers modules at mtp.layers.{j}:
  mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight [H] ((1 + w) norms); mtp.fc.weight [H, 2 H];
  mtp.layers.0.*: a gated full-attention layer with a dense SwiGLU MLP; mtp.norm.weight [H]; the target's lm_head.
  h' = norm(Block(fc(concat(norm_e(embed(t_{i+1})), norm_h(h_i))))), logits = lm_head(h').

h_i is the target's hidden state at position i after its final norm (the forward's output: what vLLM hands its
drafts as target_hidden_states). Each next draft runs the module again on h' and the token just drafted (vLLM's
recursion when num_speculative_tokens exceeds the modules). The block's weights load as the target's layer L
would (FP8 block scales, int4 dequantized to float32 here), under the module's engine names mtp.{MTP_NAMES}.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from engine.loader.hf import read_weights
from engine.loader.safetensors_io import SafetensorsCheckpoint
from engine.model_files import ModelLoadError
from engine.models.decoder import DecoderLM
from engine.models.mtp_module import MtpModule

log = logging.getLogger(__name__)

MTP_NAMES = ("enorm", "hnorm", "eh_proj", "norm", "head")      # the module's own weights: mtp.{name}


@dataclass
class MtpLayer:
    layer: int                          # its block's layer index (the target's num_hidden_layers)
    module: MtpModule                   # how the line's module runs
    weights: dict[str, np.ndarray]      # layers.{layer}.* as the target's layer would load, and mtp.{MTP_NAMES}


def load_mtp_layer(folder: str, model: DecoderLM) -> MtpLayer:
    """The first MTP module of the target in `folder`; ValueError for a line that has none, ModelLoadError for a
    checkpoint without one or whose tensors do not fit."""
    module = model.mtp_module()
    if module is None:
        raise ValueError(f"--speculative-config: method 'mtp' runs the multi-token-prediction layers of DeepSeek-V3 "
                         f"/ Kimi-K2 and Qwen3.5; this model is {model.model_type!r}, which the engine runs no MTP "
                         f"layers of")
    L = model.config.num_hidden_layers
    ckpt = SafetensorsCheckpoint(folder)
    if not module.count or module.marker not in ckpt:
        raise ModelLoadError(f"--speculative-config: method 'mtp': {folder} has no multi-token-prediction layer "
                             f"({module.count_key} = {module.count}; {module.marker} "
                             f"{'present' if module.marker in ckpt else 'absent'})")
    try:
        weights = read_weights(ckpt, model, lambda has: model.mtp_weight_specs(L, has), np.float32, folder)
    except ValueError as e:        # a tensor missing (ModelLoadError), or not of its layout shape
        raise ModelLoadError(f"--speculative-config: method 'mtp': {e.args[0]}") from None
    if module.count > 1:
        log.warning("mtp: %d MTP modules in the checkpoint; the first drafts every token, applied recursively (vLLM "
                    "runs module j at draft step j: the others are not run here, so acceptance past the first draft "
                    "may be lower than vLLM's)", module.count)
    return MtpLayer(layer=L, module=module, weights=weights)
