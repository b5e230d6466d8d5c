"""Random weights of a DeepSeek-V3 / Kimi-K2 or DeepSeek-V4 config in a real checkpoint format, made on the GPU
(torch; device="cpu" for the tests) and written as safetensors shards (one per layer) that the engine's loader reads
as a real checkpoint:

* "int4" (DeepSeek-V3 line): Kimi-K2-Thinking's: the routed experts as compressed-tensors pack-quantized symmetric
  int4, group 32, bf16 scales; everything else bf16.
* "fp8" (DeepSeek-V3 line): DeepSeek-V3's / Kimi-K2-Instruct's: every projection of the decoder layers float8 e4m3
  with float32 128 x 128 block scales (weight_scale_inv); router, norms, embedding and lm_head bf16 (the router's
  score correction bias float32).
* "fp8" (DeepSeek-V4, model_type deepseek_v4): DeepSeek-V4's: the attention's projections (wq_a, wq_b, wkv, wo_a,
  wo_b), the indexer's wq_b and the shared expert float8 e4m3 with ue8m0 128 x 128 block scales; the routed experts
  FP4: int8 bytes [N, K / 2] of two e2m1 values (element 2k in the low nibble of byte k) with one ue8m0 scale per
  [1, 32] block, both under the `weight` / `weight_scale_inv` names (the loader tells FP4 by the int8 dtype);
  the compressors' wkv / wgate, the indexer's weights_proj, the router, norms, embedding and head bf16; the
  hyper-connections (hc_*), attention sinks, the compressors' ape and the router bias float32; the hash layers'
  tid2eid an int32 table of distinct experts per token.

Values: matrices ~ N(0, 1/fan_in) (the hyper-connections' hc_*_fn too: ~0.008 at V4-Flash's width), norms and
hyper-connection scales ~ 1 + N(0, 0.1), the router bias ~ N(0, 0.01), sinks, hyper-connection bases and ape
~ N(0, 0.1), embedding ~ N(0, 0.06) (as harness write_random_qwen3). The tensor names and shapes are the engine
line's own declaration (weight_specs), so nothing here restates the layout. Returns {checkpoint weight name:
stored bytes of it and its scales}.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np

EXPERT = ".experts."       # a routed expert (V3: mlp.experts.e, V4: ffn.experts.e), not shared_experts
FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_BLOCK = 32
# DeepSeek-V4's FP8 projections (the rest of its 2-D weights stay bf16)
V4_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])\.weight$")
V4_F32 = re.compile(r"(hc_[a-z_]+|attn_sink|\.ape|\.gate\.bias)$")


def _random(name: str, shape, g):
    import torch
    randn = torch.randn(shape, generator=g, device=g.device)
    if name.endswith(("e_score_correction_bias", ".gate.bias")):
        return randn * 0.01
    if name.endswith(("attn_sink", "_base", ".ape")):
        return randn * 0.1
    if len(shape) == 1:
        return 1 + 0.1 * randn
    std = 0.06 if "embed_tokens" in name else shape[-1] ** -0.5
    return randn * std


def _ue8m0(scale) -> tuple:
    """(scale rounded up to a power of two, its ue8m0 bytes as numpy float8_e8m0fnu)."""
    import ml_dtypes
    import torch
    exp = torch.ceil(torch.log2(scale.clamp(min=2.0 ** -126))).clamp(-127, 127)
    return torch.exp2(exp), (exp + 127).to(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e8m0fnu)


def _fp8_block(w, block: int = 128, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 e4m3 [N, K], scale_inv [ceil(N/128), ceil(K/128)]: float32 amax / 448, or ue8m0 rounded up to a power
    of two)."""
    import ml_dtypes
    import torch
    N, K = w.shape
    gn, gk = -(-N // block), -(-K // block)
    pad = torch.nn.functional.pad(w, (0, gk * block - K, 0, gn * block - N))
    tiles = pad.reshape(gn, block, gk, block)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    if ue8m0:
        scale_inv, stored = _ue8m0(scale_inv)
    else:
        stored = scale_inv.float().cpu().numpy()
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(gn * block, gk * block)[:N, :K].contiguous()
    return q.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn), stored


def _fp4_block(w, block: int = FP4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [N, K / 2]: two e2m1 codes a byte, element 2k in the low nibble; ue8m0 scales [N, K / block], the
    power of two at or above amax / 6 of each block): round to the nearest e2m1 value."""
    import torch
    N, K = w.shape
    g = w.float().reshape(N, K // block, block)
    scale, stored = _ue8m0(g.abs().amax(-1) / FP4_MAX)
    x = g / scale[..., None]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=w.device)    # between e2m1 magnitudes
    code = torch.bucketize(x.abs(), mids).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)
    code = code.reshape(N, K)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous().cpu().numpy().view(np.int8), stored


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


def _tid2eid(shape, experts: int, g) -> np.ndarray:
    """int32 [vocab, top_k]: distinct experts per token, uniformly drawn."""
    import torch
    return torch.rand((shape[0], experts), generator=g, device=g.device).topk(shape[1], dim=-1).indices \
        .to(torch.int32).cpu().numpy()


def _kind(n: str, shape, fmt: str, v4: bool) -> str:
    """How tensor n is stored: fp4, fp8 (float32 scales), fp8_ue8m0, int4, int32, f32 or bf16."""
    if v4:
        if n.endswith(".tid2eid"):
            return "int32"
        if fmt == "fp8" and EXPERT in n:
            return "fp4"
        if fmt == "fp8" and V4_FP8.search(n):
            return "fp8_ue8m0"
        return "f32" if V4_F32.search(n) else "bf16"
    if fmt == "int4" and EXPERT in n:
        return "int4"
    if fmt == "fp8" and n.startswith("model.layers.") and len(shape) == 2 and ".gate.weight" not in n:
        return "fp8"
    return "f32" if n.endswith("e_score_correction_bias") else "bf16"


def stored_nbytes(kind: str, shape) -> int:
    """Bytes of a tensor stored as `kind`, with its scales."""
    size = int(np.prod(shape, dtype=np.int64))
    if kind == "fp4":
        return size // 2 + size // FP4_BLOCK
    if kind.startswith("fp8"):
        scales = -(-shape[0] // 128) * -(-shape[1] // 128)
        return size + scales * (1 if kind == "fp8_ue8m0" else 4)
    if kind == "int4":
        return size // 2 + size // 32 * 2 + 16
    return size * (2 if kind == "bf16" else 4)


def _tensors(n: str, shape, kind: str, g, experts: int) -> dict[str, np.ndarray]:
    """The checkpoint tensors of weight n (the weight and its scales), drawn from g."""
    if kind == "int32":
        return {n: _tid2eid(shape, experts, g)}
    w, base = _random(n, shape, g), n[:-len("weight")]
    if kind == "int4":
        packed, scale = _int4_group(w)
        return {base + "weight_packed": packed, base + "weight_scale": scale,
                base + "weight_shape": np.array(shape, np.int64)}
    if kind == "fp4":
        q, s = _fp4_block(w)
        return {n: q, base + "weight_scale_inv": s}
    if kind.startswith("fp8"):
        q, s = _fp8_block(w, ue8m0=kind == "fp8_ue8m0")
        return {n: q, base + "weight_scale_inv": s}
    return {n: w.float().cpu().numpy() if kind == "f32" else _bf16(w)}


def planned_bytes(config_path: str, fmt: str) -> dict[str, int]:
    """{checkpoint weight name: stored bytes} of write_random_quantized's checkpoint, without writing it."""
    from engine.model_config import ModelConfig
    from engine.models.registry import build_model

    with open(config_path) as f:
        cfg = json.load(f)
    v4 = cfg.get("model_type") == "deepseek_v4"
    model = build_model(ModelConfig.from_dict({**cfg, **quantization_config(cfg.get("model_type"), fmt)}))
    return {n: stored_nbytes(_kind(n, s, fmt, v4), s) for spec in model.weight_specs() for n, s in spec.parts}


def quantization_config(model_type: str, fmt: str) -> dict:
    """The config.json entries a checkpoint of `fmt` ships."""
    if model_type == "deepseek_v4":
        if fmt != "fp8":
            raise ValueError(f"deepseek_v4 checkpoints: format fp8 (FP8 projections, FP4 experts), not {fmt!r}")
        return {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
                "expert_dtype": "fp4"}
    if fmt == "fp8":
        return {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}}
    if fmt == "int4":
        return {"quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}}
    raise ValueError(f"unknown checkpoint format {fmt!r} (int4, fp8)")


def write_word_tokenizer(out_dir: str, vocab: int) -> None:
    """A word-level tokenizer of exactly `vocab` ids ("<unk>", "<eos>", then "w2".."w{vocab-1}", split on
    whitespace) into out_dir: text a serving benchmark sends to a random checkpoint whose real tokenizer is not
    at hand encodes only to ids the embedding holds."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<eos>"])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "unk_token": "<unk>", "model_max_length": 1 << 20}, f)


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
    v4 = cfg.get("model_type") == "deepseek_v4"
    cfg.update(quantization_config(cfg.get("model_type"), fmt))
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
            made = _tensors(n, shape, _kind(n, shape, fmt, v4), g, int(cfg.get("n_routed_experts") or 0))
            tensors.update(made)
            sizes[n] = sum(a.nbytes for a in made.values())
        file = f"model-{key}.safetensors"
        save_safetensors(os.path.join(out_dir, file), tensors)
        weight_map.update({k: file for k in tensors})
        del tensors
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    folder, rows = tokenizer_source()[:2]
    if rows > model.config.vocab_size:       # its ids would pass the embedding's rows (V4: 129,280 < Qwen's)
        write_word_tokenizer(out_dir, model.config.vocab_size)
    else:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if os.path.isfile(os.path.join(folder, f)):
                shutil.copy(os.path.join(folder, f), out_dir)
    with open(sizes_path, "w") as f:
        json.dump(sizes, f)
    open(done, "w").close()
    return sizes
