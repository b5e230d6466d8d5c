"""A torch reference of an MTP module's drafting, written from the definition (DeepSeek-V3's MTP; vLLM's
deepseek_mtp.py), the oracle of the engine's numpy draft. The target's last hidden state h_i (before its final
norm) comes from transformers (a hook on its last decoder layer); the module's decoder block is transformers' own
DeepseekV3 decoder layer, run as a one-layer transformers model whose input embeddings are the module's
eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i))) and whose final norm and lm_head are shared_head.norm and
shared_head.head.

Drafting after tokens t_0..t_n whose first n the target has computed: the module runs over positions 0..n-1; the
first draft is the argmax of its logits at n - 1; each next draft runs the module at the next position on its
last pre-norm output and the draft just made, attending to every earlier position (the drafts' too).
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


class MtpReference:
    def __init__(self, folder: str):
        from safetensors.torch import load_file

        from harness.models import hf_model
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        self.target, self.eps, L = hf_model(folder), cfg["rms_norm_eps"], cfg["num_hidden_layers"]
        raw = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
        m = f"model.layers.{L}."
        self.w = {k[len(m):]: v for k, v in raw.items() if k.startswith(m)}
        self.block = self._block_model(folder, cfg, raw, L)
        self.embed = raw["model.embed_tokens.weight"]

    def _block_model(self, folder: str, cfg: dict, raw: dict, L: int):
        """The module's block as a one-layer transformers DeepseekV3 (MoE where layer L is), its final norm and
        lm_head the module's shared_head, loaded by transformers from a folder written beside `folder`."""
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM
        own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
        state = {f"model.layers.0.{k}": v for k, v in self.w.items() if not k.startswith(own)}
        state.update({"model.norm.weight": self.w["shared_head.norm.weight"],
                      "lm_head.weight": self.w.get("shared_head.head.weight", raw["lm_head.weight"]),
                      "model.embed_tokens.weight": raw["model.embed_tokens.weight"]})
        out = folder.rstrip("/") + "_mtp_block"
        os.makedirs(out, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"))
        dense = 0 if L >= cfg["first_k_dense_replace"] else 1
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**cfg, "num_hidden_layers": 1, "num_nextn_predict_layers": 0, "first_k_dense_replace": dense}, f)
        model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                           output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        return model.eval()

    def _input(self, hidden, tokens):
        e = _rms(self.embed[torch.tensor(tokens)], self.w["enorm.weight"], self.eps)
        h = _rms(hidden, self.w["hnorm.weight"], self.eps)
        return torch.cat([e, h], -1) @ self.w["eh_proj.weight"].T

    def _run(self, x):
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
        last = []
        handle = _output(self.target.model.layers[-1], last)
        try:
            self.target(torch.tensor([tokens[:computed]]))
        finally:
            handle.remove()
        x = self._input(last[0][0], tokens[1:computed + 1])
        drafts, margins = [], []
        for _ in range(k):
            logits, prenorm = self._run(x)
            top = torch.topk(logits, 2).values
            drafts.append(int(logits.argmax()))
            margins.append(float(top[0] - top[1]))
            x = torch.cat([x, self._input(prenorm[None], drafts[-1:])])
        return drafts, margins
