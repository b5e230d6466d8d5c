"""Torch references of an MTP module's drafting, written from the definition (vLLM's deepseek_mtp.py and
qwen3_5_mtp.py), the oracles of the engine's numpy draft. The target's hidden state h_i is transformers' own,
after its final norm (the base model's last_hidden_state: what vLLM hands its drafts); the module's decoder block
is transformers' own decoder layer of the line, run as a one-layer transformers model whose input embeddings are
fc(concat(norm_e(embed(t_{i+1})), norm_h(h_i))) and whose final norm and lm_head are the module's.

  DeepSeek-V3 / Kimi-K2: enorm / hnorm / eh_proj; the embedding zero at position 0; logits
    shared_head.head(shared_head.norm(h')); the next draft's hidden h' before that norm.
  Qwen3.5: (1 + w) norms pre_fc_norm_embedding / pre_fc_norm_hidden, fc; logits lm_head(mtp.norm(h'')); the next
    draft's hidden mtp.norm(h'') (the block model's last_hidden_state).

Drafting after tokens t_0..t_n whose first n the target has computed: the module runs over positions 0..n-1; the
first draft is the argmax of its logits at n - 1; each next draft runs the module at the next position on its
last output and the draft just made, attending to every earlier position (the drafts' too).
"""
from __future__ import annotations

import json
import os

import torch


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _output(module, store):
    def hook(_mod, _args, out):
        store.append(out[0] if isinstance(out, tuple) else out)
    return module.register_forward_hook(hook)


def _raw(folder: str) -> dict:
    from safetensors.torch import load_file
    raw = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            raw.update({k: v.float() for k, v in load_file(os.path.join(folder, f)).items()})
    return raw


def _one_layer_model(folder: str, config: dict, state: dict):
    """A transformers model of `config` from `state`, written to `folder` (every tensor loads, none missing)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


class MtpReference:
    """DeepSeek-V3 / Kimi-K2's module at model.layers.{L}."""
    masks_first = True

    def __init__(self, folder: str):
        from harness.models import hf_model
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        raw, L = _raw(folder), cfg["num_hidden_layers"]
        self.target, self.eps, self.embed = hf_model(folder), cfg["rms_norm_eps"], raw["model.embed_tokens.weight"]
        m = f"model.layers.{L}."
        w = {k[len(m):]: v for k, v in raw.items() if k.startswith(m)}
        self.norm_e, self.norm_h, self.fc = w["enorm.weight"], w["hnorm.weight"], w["eh_proj.weight"]
        own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
        state = {f"model.layers.0.{k}": v for k, v in w.items() if not k.startswith(own)}
        state.update({"model.norm.weight": w["shared_head.norm.weight"],
                      "lm_head.weight": w.get("shared_head.head.weight", raw["lm_head.weight"]),
                      "model.embed_tokens.weight": raw["model.embed_tokens.weight"]})
        dense = 0 if L >= cfg["first_k_dense_replace"] else 1
        self.block = _one_layer_model(folder.rstrip("/") + "_mtp_block", {
            **cfg, "num_hidden_layers": 1, "num_nextn_predict_layers": 0, "first_k_dense_replace": dense}, state)

    def _norm(self, x, w):
        return _rms(x, w, self.eps)

    def _input(self, hidden, tokens, first: int):
        """fc(concat(norm_e(e), norm_h(h))) of the rows at positions first, first + 1, ..."""
        e = self.embed[torch.tensor(tokens)]
        if self.masks_first and first == 0:
            e = torch.cat([torch.zeros_like(e[:1]), e[1:]])
        return torch.cat([self._norm(e, self.norm_e), self._norm(hidden, self.norm_h)], -1) @ self.fc.T

    def _run(self, x):
        """The block over x: (logits of the last row, the last row's next hidden input)."""
        prenorm = []
        handle = _output(self.block.model.layers[0], prenorm)
        try:
            logits = self.block(inputs_embeds=x[None], position_ids=torch.arange(len(x))[None]).logits[0]
        finally:
            handle.remove()
        return logits[-1], prenorm[0][0, -1]

    @torch.no_grad()
    def drafts(self, tokens: list[int], computed: int, k: int) -> tuple[list[int], list[float]]:
        """k drafts after `tokens` (the target computed the first `computed`), and each draft's margin (its
        logit over the runner-up's)."""
        hidden = self.target.model(torch.tensor([tokens[:computed]])).last_hidden_state[0]
        x = self._input(hidden, tokens[1:computed + 1], 0)
        drafts, margins = [], []
        for _ in range(k):
            logits, nxt = self._run(x)
            top = torch.topk(logits, 2).values
            drafts.append(int(logits.argmax()))
            margins.append(float(top[0] - top[1]))
            x = torch.cat([x, self._input(nxt[None], drafts[-1:], len(x))])
        return drafts, margins


class Qwen35MtpReference(MtpReference):
    """Qwen3.5's module at mtp.* (either checkpoint form)."""
    masks_first = False

    def __init__(self, folder: str):
        from harness.hybrid_models import hybrid_hf_model
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        text = cfg.get("text_config", cfg)
        raw = _raw(folder)
        embed = raw.get("model.embed_tokens.weight", raw.get("model.language_model.embed_tokens.weight"))
        self.target, self.eps, self.embed = hybrid_hf_model(folder), text["rms_norm_eps"], embed
        self.norm_e, self.norm_h = raw["mtp.pre_fc_norm_embedding.weight"], raw["mtp.pre_fc_norm_hidden.weight"]
        self.fc = raw["mtp.fc.weight"]
        tied = bool(cfg.get("tie_word_embeddings", False))
        state = {f"model.layers.0.{k[len('mtp.layers.0.'):]}": v for k, v in raw.items() if k.startswith("mtp.layers.0.")}
        state.update({"model.norm.weight": raw["mtp.norm.weight"], "model.embed_tokens.weight": embed})
        if not tied:
            state["lm_head.weight"] = raw["lm_head.weight"]
        self.block = _one_layer_model(folder.rstrip("/") + "_mtp_block", {
            **text, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 1,
            "layer_types": ["full_attention"], "tie_word_embeddings": tied}, state)

    def _norm(self, x, w):
        return _rms(x, 1 + w, self.eps)

    def _run(self, x):
        out = self.block.model(inputs_embeds=x[None], position_ids=torch.arange(len(x))[None]).last_hidden_state[0]
        return self.block.lm_head(out[-1]), out[-1]
