"""Tiny dense folders in FP8 (W8A8) and INT4 (W4A16) for the quantized gates, and transformers oracles on their
dequantized weights.

`fp8_tiny(line, fmt)`: a tiny random model of that line at widths W8A8 takes (hidden, heads · head_dim, the
MLP and the KV rows multiples of 128, so fused q/k/v block scales stack), written as an FP8 folder ("block":
quant_method fp8 with [128, 128] `weight_scale_inv`; "channel": compressed-tensors float-quantized) and as
the float32 folder of its dequantized weights (the oracle's). The oracles (transformers, float32, eager) on
that folder: `hf_logits` plain; `hf_w8a8_logits` with each decoder projection's input quantized per token and
128-wide group to e4m3 first (torch's own cast: the activation quantization of vLLM's dynamic scheme);
`hf_bf16_logits` the model in bf16 (the bf16 floor); `hf_w8a8_moe_logits` with the routed experts' inputs quantized
too (MoE folders whose experts are kept in FP8). `int4_tiny(line, method)`: the same tiny model in AWQ or
GPTQ int4 (harness.quantized.int4_folder) and the float32 folder of the writer's own dequantized values.
"""
from __future__ import annotations

import copy
import functools
import os

import numpy as np

from harness.models import _tmp_root, build_tiny_model, hf_model
from harness.quantized import (LAYER_LINEAR, dequantized_copy, fp8_channel_folder, fp8_folder, int4_folder,
                               packed_int4_folder)

W8A8_WIDTHS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=32)
FP8_LINES = {"qwen3": "qwen3_untied", "llama": "llama", "qwen2": "qwen2"}     # line -> its TINY_MODELS base
FLOAT32_JITTER = 2.0 ** -20      # relative: 8 float32 ulps, the spread another summation order gives a product
FLOOR_JITTERS = 4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# Two ranks' shards still whole 128-row blocks and 128-wide groups: each rank's q / k / v rows (one head of 128),
# o_proj's and down_proj's K shares (128)
TP2_WIDTHS = dict(W8A8_WIDTHS, num_attention_heads=2, num_key_value_heads=2, head_dim=128)


def tiny_source(line: str, tp2: bool = False) -> str:
    """The bf16 tiny `line` model at the widths the quantized formats take (tp2: that two ranks' shards take; qwen3
    only), built once."""
    src = os.path.join(_tmp_root(), f"{line}-w8a8" + ("-tp2" if tp2 else ""))
    if not os.path.isdir(src):
        widths = TP2_WIDTHS if tp2 else W8A8_WIDTHS
        overrides = {k: v for k, v in widths.items() if line == "qwen3" or k != "head_dim"}
        build_tiny_model(FP8_LINES[line], src, **overrides)
    return src


@functools.lru_cache(maxsize=None)
def int4_tiny(line: str, method: str, tp2: bool = False) -> tuple[str, str]:
    """(the AWQ / GPTQ / compressed-tensors pack-quantized folder, the float32 folder of its dequantized weights) of a
    tiny `line` model (tp2: tiny_source's)."""
    src = tiny_source(line, tp2)
    if method == "compressed-tensors":
        return packed_int4_folder(src, f"{src}-ct", f"{src}-ct-ref", LAYER_LINEAR, group=128)
    return int4_folder(src, f"{src}-{method}", f"{src}-{method}-ref", method)


@functools.lru_cache(maxsize=None)
def fp8_tiny(line: str, fmt: str = "block", tp2: bool = False) -> tuple[str, str]:
    """(the FP8 folder, the float32 folder of its dequantized weights) of a tiny `line` model (tp2: tiny_source's)."""
    src = tiny_source(line, tp2)
    dst = f"{src}-fp8-{fmt}"
    fp8_folder(src, dst, (128, 128)) if fmt == "block" else fp8_channel_folder(src, dst)
    return dst, dequantized_copy(dst, dst + "-ref")


MOE_W8A8_WIDTHS = {"qwen3_moe": dict(W8A8_WIDTHS, moe_intermediate_size=128),      # q, k, v rows: whole blocks
                   "qwen3_moe-tp2": dict(TP2_WIDTHS, moe_intermediate_size=128),
                   "deepseek_v3": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128)}


def moe_source(line: str, tp2: bool = False) -> str:
    """The bf16 tiny MoE `line` model at MOE_W8A8_WIDTHS (tp2: two ranks' shards whole blocks), built once."""
    key = line + ("-tp2" if tp2 else "")
    src = os.path.join(_tmp_root(), f"{key}-moe-w8a8")
    if not os.path.isdir(src):
        build_tiny_model(line, src, **MOE_W8A8_WIDTHS[key])
    return src


@functools.lru_cache(maxsize=None)
def fp8_moe_tiny(line: str, tp2: bool = False) -> tuple[str, str]:
    """(the FP8 block-scaled folder, the float32 folder of its dequantized weights) of a tiny MoE `line` model
    whose routed experts (and, for qwen3_moe, attention and dense MLP) W8A8 keeps: K multiples of 128."""
    src = moe_source(line, tp2)
    dst = fp8_folder(src, f"{src}-fp8", (128, 128))
    return dst, dequantized_copy(dst, dst + "-ref")


def fake_quant_e4m3(x):
    """x [..., K] (torch) quantized per row and 128-wide group to e4m3 and back: s = max(amax, 1e-10) / 448,
    x ~ e4m3(clamp(x / s)) · s."""
    import torch
    g = x.float().to(x.dtype).reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(x.shape).to(x.dtype)


def with_w8a8_hooks(model, projections: tuple[str, ...] = PROJECTIONS, jitter_seed: int | None = None):
    """model (transformers) with each decoder projection's input fake-quantized first (fake_quant_e4m3);
    jitter_seed: each input first scaled by 1 + u · FLOAT32_JITTER, u uniform in [-1, 1) drawn from a generator of
    that seed (float32 noise before the e4m3 cast, as another summation order gives it)."""
    import torch
    gen = None if jitter_seed is None else torch.Generator().manual_seed(jitter_seed)

    def quantize(_m, args):
        x = args[0]
        if gen is not None:
            x = x * (1 + (2 * torch.rand(x.shape, generator=gen, dtype=x.dtype) - 1) * FLOAT32_JITTER)
        return (fake_quant_e4m3(x),)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in projections:
            module.register_forward_pre_hook(quantize)
    return model


@functools.lru_cache(maxsize=16)
def _w8a8_model(path: str, double: bool, jitter_seed: int | None = None):
    model = copy.deepcopy(hf_model(path))
    return with_w8a8_hooks(model.double() if double else model, jitter_seed=jitter_seed)


@functools.lru_cache(maxsize=4)
def _bf16_model(path: str):
    import torch
    return copy.deepcopy(hf_model(path)).to(torch.bfloat16)


def with_w8a8_experts(model):
    """model (transformers) with each routed-experts module run by its own eager forward (the class's, undecorated)
    with the input of every expert product fake-quantized first (fake_quant_e4m3): kept FP8 experts' W8A8."""
    for name, module in model.named_modules():
        if name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            eager = getattr(type(module).forward, "__wrapped__", type(module).forward)
            module.forward = functools.partial(_quantized_linears, eager, module)
    return model


def _quantized_linears(forward, module, *args, **kwargs):
    import torch.nn.functional as F
    linear = F.linear
    F.linear = lambda x, w, b=None: linear(fake_quant_e4m3(x), w, b)
    try:
        return forward(module, *args, **kwargs)
    finally:
        F.linear = linear


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
KEPT_PROJECTIONS = {"qwen3_moe": PROJECTIONS, "deepseek_v3": MLP_PROJECTIONS}    # beside the routed experts


def with_w8a8_moe(model, line: str):
    """model with what `line` keeps in FP8 W8A8: its routed experts and KEPT_PROJECTIONS[line]."""
    return with_w8a8_experts(with_w8a8_hooks(model, KEPT_PROJECTIONS[line]))


@functools.lru_cache(maxsize=4)
def _w8a8_moe_model(path: str, line: str, double: bool):
    model = copy.deepcopy(hf_model(path))
    return with_w8a8_moe(model.double() if double else model, line)


def hf_w8a8_moe_logits(path: str, ids: list[int], line: str, double: bool = False) -> np.ndarray:
    """The W8A8 oracle of an FP8 MoE folder of `line` (with_w8a8_moe); double: in float64 (the floor)."""
    return _logits(_w8a8_moe_model(path, line, double), ids)


def _logits(model, ids: list[int]) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_w8a8_logits(path: str, ids: list[int], double: bool = False, jitter_seed: int | None = None) -> np.ndarray:
    """double: the model in float64 (the activations quantized from float32 copies): W8A8's float32 floor;
    jitter_seed: float32 with its projections' inputs jittered (with_w8a8_hooks), another float32 realization."""
    return _logits(_w8a8_model(path, double, jitter_seed), ids)


def hf_w8a8_floors(path: str, prompts: list[list[int]], jitters: int = FLOOR_JITTERS) -> list[list[np.ndarray]]:
    """The W8A8 oracle's float32 floor realizations, each a run of `prompts`: in float64, and in float32 with its
    inputs jittered (seeds 1..jitters). An e4m3 cast turns float32 noise into whole e4m3 steps now and then, which
    a tiny random model can carry into other argmaxes: one realization alone underrates what float32 can do."""
    return [[hf_w8a8_logits(path, p, double=True) for p in prompts]] + [
        [hf_w8a8_logits(path, p, jitter_seed=seed) for p in prompts] for seed in range(1, jitters + 1)]


def hf_bf16_logits(path: str, ids: list[int]) -> np.ndarray:
    return _logits(_bf16_model(path), ids)
