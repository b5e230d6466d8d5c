"""Random weights of a DeepSeek-V3 / Kimi-K2 config in a real checkpoint format, made on the GPU (torch) and
written as safetensors shards (one per layer) that the engine's loader reads as a real checkpoint:

* "int4": Kimi-K2-Thinking's: the routed experts as compressed-tensors pack-quantized symmetric int4, group
  32, bf16 scales; everything else bf16.
* "fp8": DeepSeek-V3's / Kimi-K2-Instruct's: every projection of the decoder layers float8 e4m3 with float32
  128 x 128 block scales (weight_scale_inv); router, norms, embedding and lm_head bf16 (the router fp32).

Values: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1), the router's score correction bias ~ N(0, 0.01),
embedding ~ N(0, 0.06) (as harness write_random_qwen3). The tensor names and shapes are the engine line's
own declaration (weight_specs), so nothing here restates the layout. Returns {name: stored bytes}.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

EXPERT = ".mlp.experts."
FP8_MAX = 448.0


def _random(name: str, shape, g):
    import torch
    if len(shape) == 1:
        if name.endswith("e_score_correction_bias"):
            return torch.randn(shape, generator=g, device=g.device) * 0.01
        return 1 + 0.1 * torch.randn(shape, generator=g, device=g.device)
    std = 0.06 if "embed_tokens" in name else shape[-1] ** -0.5
    return torch.randn(shape, generator=g, device=g.device) * std


def _fp8_block(w, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    import ml_dtypes
    import torch
    N, K = w.shape
    gn, gk = -(-N // block), -(-K // block)
    pad = torch.nn.functional.pad(w, (0, gk * block - K, 0, gn * block - N))
    tiles = pad.reshape(gn, block, gk, block)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(gn * block, gk * block)[:N, :K].contiguous()
    return (q.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn),
            scale_inv.float().cpu().numpy())


def _int4_group(w, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(weight_packed int32 [N, K/8], weight_scale bf16 [N, K/group]) as compressed-tensors packs them."""
    import ml_dtypes
    import torch
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)
    q = torch.clamp(torch.round(g / scale.float().clamp(min=1e-12)[..., None]), -8, 7).to(torch.int64) + 8
    words = (q.reshape(N, K // 8, 8) << (4 * torch.arange(8, device=w.device, dtype=torch.int64))).sum(-1)
    packed = words.cpu().numpy().astype(np.uint32).view(np.int32)         # element k at bits 4·(k % 8)
    return packed, scale.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def _bf16(t) -> np.ndarray:
    import ml_dtypes
    import torch
    return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def write_random_quantized(config_path: str, out_dir: str, fmt: str, seed: int = 0,
                           device: str = "cuda") -> dict[str, int]:
    """Write (once: reused when out_dir is complete) a random checkpoint of the config in `fmt`."""
    import torch

    from engine.loader.safetensors_io import save_safetensors
    from engine.model_config import ModelConfig
    from engine.models.registry import build_model
    from harness.models import tokenizer_source

    done, sizes_path = os.path.join(out_dir, ".complete"), os.path.join(out_dir, "stored_bytes.json")
    if os.path.exists(done):
        with open(sizes_path) as f:
            return json.load(f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    with open(config_path) as f:
        cfg = json.load(f)
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    elif fmt == "int4":
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                          "group_size": 32, "dynamic": False}}},
                                      "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                                 "re:.*mlp\\.(gate|up|down)_proj.*"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model = build_model(ModelConfig.from_dict(cfg))
    names = [(n, s) for spec in model.weight_specs() for n, s in spec.parts]
    g = torch.Generator(device=device).manual_seed(seed)
    shards: dict[str, list] = {}
    for n, s in names:
        key = n.split(".")[2] if n.startswith("model.layers.") else "rest"
        shards.setdefault(key, []).append((n, s))
    weight_map, sizes = {}, {}
    for key, group in shards.items():
        tensors = {}
        for n, shape in group:
            w = _random(n, shape, g)
            base = n[:-len("weight")]
            if fmt == "int4" and EXPERT in n:
                tensors[base + "weight_packed"], tensors[base + "weight_scale"] = _int4_group(w)
                tensors[base + "weight_shape"] = np.array(shape, np.int64)
            elif fmt == "fp8" and n.startswith("model.layers.") and len(shape) == 2 and ".gate.weight" not in n:
                tensors[n], tensors[base + "weight_scale_inv"] = _fp8_block(w)
            else:
                tensors[n] = _bf16(w) if "e_score_correction_bias" not in n else w.float().cpu().numpy()
            sizes[n] = sum(a.nbytes for k, a in tensors.items() if k.startswith(base))
        file = f"model-{key}.safetensors"
        save_safetensors(os.path.join(out_dir, file), tensors)
        weight_map.update({k: file for k in tensors})
        del tensors
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    folder = tokenizer_source()[0]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(folder, f)):
            shutil.copy(os.path.join(folder, f), out_dir)
    with open(sizes_path, "w") as f:
        json.dump(sizes, f)
    open(done, "w").close()
    return sizes
