"""A torch reference of an EAGLE-3 head's drafting, written from the definition (EAGLE-3; vLLM's
llama_eagle3.py and eagle.py), the oracle of the engine's numpy head: read straight from the head's
safetensors, the target's hidden states from transformers (output_hidden_states: hidden_states[i] is what
enters layer i), rotary from transformers' LlamaRotaryEmbedding over the head's config.

Drafting after tokens t_0..t_n whose first n the target has computed: the head runs over positions 0..n-1 with
input fc(concat of the target's hidden states entering the aux layers at p) and the embedding of t_{p+1}; the
first draft is the argmax of lm_head(norm(its last output)) mapped through d2t; each next draft runs the layer
at the next position on the last pre-norm output and the embedding of the draft just made, attending to every
earlier position's K and V (the drafts' too).
"""
from __future__ import annotations

import json
import os

import torch


def _load(head_dir: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = {**cfg.pop("transformer_layer_config", {}), **cfg}            # vLLM speculators' nesting
    raw = load_file(os.path.join(head_dir, "model.safetensors"))
    w = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in raw.items()}
    return cfg, {k: (v.float() if v.is_floating_point() else v) for k, v in w.items()}


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Eagle3Reference:
    def __init__(self, head_dir: str, target_dir: str):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        from harness.models import hf_model
        self.cfg, self.w = _load(head_dir)
        self.target = hf_model(target_dir)
        L = self.target.config.num_hidden_layers
        ids = (self.cfg.get("eagle_aux_hidden_state_layer_ids")
               or (self.cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        self.aux = list(ids) if ids else [2, L // 2, L - 3]
        fields = {k: v for k, v in self.cfg.items() if k not in ("eagle_config", "architectures", "model_type")}
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**fields))
        self.embed = self.w.get("embed_tokens.weight", self.target.get_input_embeddings().weight.detach().float())
        self.d2t = self.w.get("d2t", torch.zeros(self.cfg["draft_vocab_size"], dtype=torch.long))

    @torch.no_grad()
    def drafts(self, tokens: list[int], computed: int, k: int) -> tuple[list[int], list[float]]:
        """k drafts after `tokens` (the target computed the first `computed`), and each draft's margin (its
        logit over the runner-up's)."""
        out = self.target(torch.tensor([tokens[:computed]]), output_hidden_states=True)
        hidden = self.w["fc.weight"] @ torch.cat([out.hidden_states[i][0] for i in self.aux], -1).T
        self.keys, self.values = [], []
        pre = self._layer(hidden.T, torch.tensor(tokens[1:computed + 1]), torch.arange(computed))[-1:]
        drafts, margins = [], []
        for j in range(k):
            logits = _rms(pre, self.w["norm.weight"], self.cfg["rms_norm_eps"]) @ self.w["lm_head.weight"].T
            top = torch.topk(logits[-1], 2)
            d = int(top.indices[0])
            drafts.append(d + int(self.d2t[d]))
            margins.append(float(top.values[0] - top.values[1]))
            if j + 1 < k:
                pre = self._layer(pre, torch.tensor(drafts[-1:]), torch.tensor([computed + j]))
        return drafts, margins

    def _layer(self, hidden, tokens, positions):
        c, w, m = self.cfg, self.w, "midlayer."
        eps, D, Hq, Hkv = c["rms_norm_eps"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        emb = _rms(self.embed[tokens], w[m + "input_layernorm.weight"], eps)
        normed = _rms(hidden, w[m + "hidden_norm.weight"], eps)
        residual = normed if c.get("norm_before_residual") else hidden
        x = torch.cat([emb, normed], -1)
        n = len(positions)
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(n, Hq, D).transpose(0, 1)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(n, Hkv, D).transpose(0, 1)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(n, Hkv, D).transpose(0, 1)
        cos, sin = self.rotary(x[None], positions[None])
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        self.keys.append(k)
        self.values.append(v)
        keys = torch.cat(self.keys, 1).repeat_interleave(Hq // Hkv, 0)
        values = torch.cat(self.values, 1).repeat_interleave(Hq // Hkv, 0)
        scores = q @ keys.transpose(1, 2) / D ** 0.5
        total = keys.shape[1]
        mask = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ values
        h = attn.transpose(0, 1).reshape(n, Hq * D) @ w[m + "self_attn.o_proj.weight"].T + residual
        act = _rms(h, w[m + "post_attention_layernorm.weight"], eps)
        gate, up = act @ w[m + "mlp.gate_proj.weight"].T, act @ w[m + "mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w[m + "mlp.down_proj.weight"].T + h
