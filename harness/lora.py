"""LoRA helpers shared by the tests and the benchmark (need torch, transformers and peft): random PEFT
adapters of the tiny models, written by peft itself, and the transformers + peft float32 oracle.

    from harness.lora import TINY_ADAPTERS, tiny_adapter_path, hf_lora_logits, peft_model
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import struct

import numpy as np

from harness.models import _tmp_root, tiny_model_path

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig settings: different ranks, target sets (whole and partial packed projections), rsLoRA
TINY_ADAPTERS: dict[str, dict] = {
    "attn8": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
    "mlp4_rs": dict(r=4, lora_alpha=8, target_modules=MLP, use_rslora=True),
    "mixed16": dict(r=16, lora_alpha=24, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
}
# per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern: a module name, a full path, a regex)
PATTERNED_ADAPTERS: dict[str, dict] = {
    "patterned8": dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP,
                       rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 12},
                       alpha_pattern={r"layers\.0\.self_attn\.[kv]_proj": 3, "up_proj": 40}),
}


def randomize_lora_(model, seed: int, b_std: float = 0.05) -> None:
    """A ~ N(0, 1/K), B ~ N(0, b_std²) (PEFT's own init leaves B zero: no delta to check)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)


def write_peft_adapter(base_path: str, out_dir: str, seed: int = 0, **lora) -> str:
    """A random LoRA adapter of the model at base_path, saved by peft (adapter_config.json +
    adapter_model.safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora))
    randomize_lora_(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@functools.lru_cache(maxsize=None)
def tiny_adapter_path(model: str, adapter: str) -> str:
    """Adapter `adapter` of TINY_ADAPTERS (or PATTERNED_ADAPTERS) for tiny model `model`, written once per
    process."""
    names = sorted(TINY_ADAPTERS) + sorted(PATTERNED_ADAPTERS)
    settings = TINY_ADAPTERS.get(adapter) or PATTERNED_ADAPTERS[adapter]
    return write_peft_adapter(tiny_model_path(model), os.path.join(_tmp_root(), f"{model}-lora-{adapter}"),
                              seed=names.index(adapter) + 1, **settings)


def adapter_copy(folder: str, out, **config) -> str:
    """A copy of the adapter `folder` at `out` with `config` written over its adapter_config.json."""
    shutil.copytree(folder, out)
    path = os.path.join(out, "adapter_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**cfg, **config}, f)
    return str(out)


def malformed_adapter(folder: str, out: str) -> str:
    """A copy of the adapter `folder` at `out` whose safetensors header's one entry lacks its data_offsets."""
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                         {"dtype": "F32", "shape": [8, 64]}}).encode()
    shutil.copytree(folder, out)
    with open(os.path.join(out, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(2048))
    return str(out)


def peft_model(base_path: str, adapter_path: str, dtype: str = "float32", device: str = "cpu"):
    """transformers (eager attention) in `dtype` with the peft adapter applied in that dtype too."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype), attn_implementation="eager")
    return PeftModel.from_pretrained(base, adapter_path, autocast_adapter_dtype=False).to(device).eval()


@functools.lru_cache(maxsize=4)
def hf_lora_model(base_path: str, adapter_path: str):
    """The float32 CPU oracle, cached."""
    return peft_model(base_path, adapter_path)


def hf_lora_logits(base_path: str, adapter_path: str, ids: list[int]) -> np.ndarray:
    """float32 logits [T, V] of one sequence from transformers + peft."""
    import torch
    with torch.no_grad():
        return hf_lora_model(base_path, adapter_path)(input_ids=torch.tensor([ids])).logits[0].float().numpy()
