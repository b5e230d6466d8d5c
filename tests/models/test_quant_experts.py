"""Routed experts kept quantized (engine/models/quant_experts.py, engine/loader/kept_linear.py) on the numpy executor.

* Loading: the stacked experts of an MoE folder load kept, one object per layer and projection: FP8 block-scaled
  (tiny Qwen3-MoE and DeepSeek-V3 folders at W8A8 widths: Fp8Experts, e4m3 + float32 [128, 128] block scales),
  compressed-tensors pack-quantized int4 (the tiny Kimi-K2-Thinking-style folder: W4Experts, group 32) and
  DeepSeek-V4's FP4 (W4Experts, e2m1 + ue8m0 per 32); their dequantization is transformers' parameters (or the
  reference folder's) bit for bit; experts whose widths W8A8 cannot take load dequantized as before.
* The FP8 gate, by the floor method (DESIGN.md), against transformers float32 on the dequantized weights with
  every kept product's input quantized per token and 128-group (harness/quant_models.py hf_w8a8_moe_logits: the
  experts' own eager forward with each expert product's input fake-quantized; the kept dense projections hooked
  too: Qwen3-MoE's attention and dense MLP, DeepSeek-V3's dense MLP and shared experts), per prompt: mean |Δlogprob| <= max(1e-4, 2 x the floor), the floor being that oracle in float64
  against itself in float32, argmax by regret missing no more positions than the float64 oracle + 1. These tiny
  random MoE models are chaotic: float32 noise can flip an e4m3 rounding, then a near-tied expert choice, and the
  flip cascades through the later positions (the float64 oracle itself does so on one Qwen3-MoE prompt), so one
  prompt of four may pass the bound if it stays inside the bf16 floor. Measured (4 prompts, transformers 5.25,
  CPU), the engine against the oracle per prompt: qwen3_moe 5e-7, 7e-7, 7e-7, 7e-4 (floors 4e-7, 6e-7, 6e-7, 7e-4);
  deepseek_v3 1e-6, 1e-5, 9e-7, 4e-5 (floors 4e-7, 9e-7, 9e-7, 4e-5; with its experts alone kept a flip at position 15
  of the fourth prompt gave 4e-3 against a floor of 1e-6: such flips pass inside the bf16 floor). The W8A8
  error itself (the engine against plain float32): qwen3_moe mean 0.11 / p99 0.56, deepseek_v3 0.16 / 1.3, against
  HF bf16's floor 0.025 / 0.31 and 0.061 / 0.76; bounded by 2 x the activation quantization's own error on HF (the
  hooked oracle against the plain one), and > 10 x the gate's bound (the gate's power).
* INT4 / FP4: exact to the dequantized weights (the kernels' bf16 values) up to accumulation: the gates of
  tests/models/test_quantized_weights.py (Kimi-K2 int4, the DeepSeek-V4 FP4 writer) now run on the kept experts; here
  the kept type and its bytes (<= 0.30 x bf16 at group 32).
"""
from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import pytest
from test_fp8_w8a8 import floor_gate
from test_golden import new_executor

from engine.loader import load_model
from engine.models.quant_experts import Fp8Experts, W4Experts
from engine.models.quant_linear import Fp8Linear
from harness.models import (
    engine_logits,
    hf_logits,
    hf_model,
    log_softmax,
    test_prompts,
    tiny_model_path,
)
from harness.quant_models import fp8_moe_tiny, hf_bf16_logits, hf_w8a8_moe_logits
from harness.quantized import fp8_folder, int4_experts_folder

@pytest.mark.parametrize("line", ["qwen3_moe", "deepseek_v3"])
def test_fp8_experts_load_kept_and_pass_the_floor_gate(line):
    path, ref = fp8_moe_tiny(line)
    model = load_model(path)
    gate_up, down = model.weights["layers.1.experts_gate_up_proj"], model.weights["layers.1.experts_down_proj"]
    assert isinstance(gate_up, Fp8Experts) and isinstance(down, Fp8Experts) and not gate_up.channel
    E, two_i, H = gate_up.shape
    assert gate_up.scale.shape == (E, two_i // 128, H // 128) and gate_up.nbytes < 0.51 * 2 * gate_up.size
    dense = ["layers.0.gate_up_proj", "layers.0.down_proj"] + (["layers.1.shared_gate_up_proj",
                                                                "layers.1.shared_down_proj"] if line == "deepseek_v3" else [])
    assert all(isinstance(model.weights[n], Fp8Linear) for n in dense)    # dense MLPs, shared experts: kept linears
    experts = hf_model(ref).model.layers[1].mlp.experts
    np.testing.assert_array_equal(np.asarray(gate_up), experts.gate_up_proj.detach().numpy())
    np.testing.assert_array_equal(np.asarray(down), experts.down_proj.detach().numpy())

    prompts = test_prompts(model.tokenizer)
    got = engine_logits(new_executor(model), prompts, prefill=4, chunks=3)
    oracle = [hf_w8a8_moe_logits(ref, p, line) for p in prompts]
    floor = [hf_w8a8_moe_logits(ref, p, line, double=True) for p in prompts]
    f32 = log_softmax(np.concatenate([hf_logits(ref, p) for p in prompts]))
    bf16 = np.abs(log_softmax(np.concatenate([hf_bf16_logits(ref, p) for p in prompts])) - f32)
    rows = [floor_gate([g], [o], [[f]]) for g, o, f in zip(got, oracle, floor)]
    assert sum(r["mean"] > r["bound"] for r in rows) <= 1, rows          # at most one prompt past a tie flip ...
    assert all(r["mean"] <= bf16.mean() and r["misses"] <= r["floor_misses"] + 1 for r in rows), rows  # ... in bf16 noise
    act_error = np.abs(log_softmax(np.concatenate(oracle)) - f32)
    plain = np.abs(log_softmax(np.concatenate(got)) - f32)
    means, floors = ([f"{r[k]:.1g}" for r in rows] for k in ("mean", "floor"))
    print(f"{line} W8A8 experts: against the oracle {means} (floors {floors}); against float32 mean "
          f"{plain.mean():.2g} p99 {np.percentile(plain, 99):.2g}; HF bf16 floor mean {bf16.mean():.2g} "
          f"p99 {np.percentile(bf16, 99):.2g}")
    assert act_error.mean() > 0 and plain.mean() <= 2 * act_error.mean(), (plain.mean(), act_error.mean())
    assert plain.mean() > 10 * max(r["bound"] for r in rows)      # the gate's power: unquantized products miss it


def test_fp8_experts_too_narrow_for_w8a8_load_dequantized():
    """Experts whose K is no multiple of 128 (the tiny DeepSeek-V3 at its own widths) load dequantized."""
    src = tiny_model_path("deepseek_v3")
    model = load_model(fp8_folder(src, src + "-fp8-experts", (8, 16)))
    assert not isinstance(model.weights["layers.1.experts_gate_up_proj"], Fp8Experts)


def test_int4_experts_load_kept_in_under_a_third_of_bf16(caplog):
    src = tiny_model_path("kimi_k2")
    path, reference = int4_experts_folder(src, src + "-int4", src + "-int4-ref", group=32)
    with caplog.at_level(logging.INFO):
        model = load_model(path)
        new_executor(model)
    ref = load_model(reference)
    for name in ("layers.1.experts_gate_up_proj", "layers.2.experts_down_proj"):
        w = model.weights[name]
        assert isinstance(w, W4Experts) and w.w4.group == 32 and not w.w4.fp4
        np.testing.assert_array_equal(np.asarray(w), np.asarray(ref.weights[name], np.float32))
        assert w.nbytes <= 0.30 * 2 * w.size
    assert not isinstance(model.weights["layers.1.shared_gate_up_proj"], W4Experts)
    assert any(r.getMessage().startswith("quantized experts_down_proj (2 layers): experts int4 symmetric, group 32")
               for r in caplog.records)


def test_the_device_counts_the_experts_kept_bytes():
    """The GPU arena (and so the KV pool, sized from what is left) counts kept experts at their kept bytes: the W4
    packed layout (about 0.56 bytes a value at group 32 with bf16 scales) and e4m3 codes + float32 block scales."""
    from engine.executor.gpu_quant_ops import device_nbytes
    from harness.quant_cases import random_w4
    from openinfer_kernels.quant.w4_layout import pack_w4
    rng = np.random.default_rng(0)
    w4 = W4Experts(random_w4(rng, "bf16", 256, 512, 32, (4,)))
    assert device_nbytes(w4) == pack_w4(w4.w4).nbytes + 3 * 256 and device_nbytes(w4) <= 0.30 * 2 * w4.size
    codes = rng.standard_normal((4, 256, 512)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    fp8 = Fp8Experts(codes, np.ones((4, 2, 4), np.float32))
    assert device_nbytes(fp8) == codes.size + 4 * 2 * 4 * 4 + 2 * 256 and device_nbytes(fp8) < 0.51 * 2 * fp8.size
