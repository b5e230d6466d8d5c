"""Quantized checkpoints dequantized at load (engine/loader/quantized.py), exact against the formats'
references:

* FP8 e4m3 with block scales: bit-identical to transformers' own dequantization (Fp8Dequantize, which
  loads such checkpoints on a machine without a GPU, and _dequantize_fp8_weight, which also takes a last
  partial block as DeepSeek's checkpoints have: kv_a_proj_with_mqa's 576 rows in 128-row blocks);
  then a tiny DeepSeek-V3 folder in FP8 loaded by transformers (its dequantization) and by the engine:
  the same weights bit for bit, the gate on the logits.
* compressed-tensors pack-quantized int4 (group 32): against a bit-by-bit packer written apart from the
  loader's unpacking (harness/quantized.py), every int4 value and bit position; compressed-tensors' own
  pack_to_int32 where that package is installed; then a tiny Kimi-K2 folder with int4 experts against
  transformers on the same weights dequantized (exact in bf16).
Each check is shown to fail on a wrong block / group / nibble order.
Then the benchmarks' checkpoint writer (bench/deepseek_weights.py) in each format, DeepSeek-V4's (FP8 projections,
FP4 experts) included: a small-width folder read by the loader (V4's gated against transformers on its dequantized
weights); and the real-width DeepSeek-V4-Flash benchmark config's 4-layer cut fits one H200.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.loader import load_model
from engine.loader.quantized import dequant_fp8_block, dequant_packed_group, quant_format, unpack_int32
from harness.models import engine_logits, hf_logits, hf_model, test_prompts, tiny_model_path
from harness.quantized import fp8_folder, int4_experts_folder, pack_int32_bitwise, quantize_int_group
from test_golden import gate_failures, new_executor


def random_fp8(shape, rng) -> np.ndarray:
    """Every finite e4m3 byte pattern is possible (0x7f / 0xff are NaN)."""
    raw = rng.integers(0, 256, shape).astype(np.uint8)
    raw[(raw & 0x7f) == 0x7f] = 0x3c
    return raw.view(ml_dtypes.float8_e4m3fn)


def hf_fp8(weight: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """transformers' dequantization: Fp8Dequantize where the blocks tile the weight, else the backward
    pass's _dequantize_fp8_weight (which takes partial blocks)."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    w = torch.from_numpy(weight.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if scale.dtype == ml_dtypes.float8_e8m0fnu:
        s = torch.from_numpy(scale.view(np.uint8).copy())            # transformers reads ue8m0 bytes as uint8
    else:
        s = torch.from_numpy(np.asarray(scale, np.float32))
    if weight.shape[0] % block[0] == 0 and weight.shape[1] % block[1] == 0:
        return Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.float32).numpy()
    return _dequantize_fp8_weight(w, s, list(block), torch.float32).numpy()


@pytest.mark.parametrize("shape,block,scales", [((256, 384), (128, 128), "f32"), ((576, 300), (128, 128), "f32"),
                                                ((96, 64), (32, 16), "f32"), ((256, 256), (128, 128), "ue8m0")])
def test_fp8_block_dequantization_is_transformers_bit_for_bit(shape, block, scales):
    rng = np.random.default_rng(sum(shape))
    w = random_fp8(shape, rng)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    s = rng.uniform(1e-4, 1e-2, grid).astype(np.float32)
    if scales == "ue8m0":
        s = rng.integers(110, 130, grid).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    got = dequant_fp8_block(w, s, block)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, hf_fp8(w, s, block))


def test_fp8_check_fails_on_a_wrong_block_order():
    """Scales applied with the grid transposed (k-blocks down the rows), or with the block's sides swapped,
    differ from transformers'."""
    rng = np.random.default_rng(1)
    w, s = random_fp8((256, 256), rng), rng.uniform(1e-3, 1e-2, (2, 2)).astype(np.float32)
    want = hf_fp8(w, s, (128, 128))
    assert not np.array_equal(dequant_fp8_block(w, s.T.copy(), (128, 128)), want)
    w2, s2 = random_fp8((128, 256), rng), rng.uniform(1e-3, 1e-2, (2, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="needs scales"):
        dequant_fp8_block(w2, s2, (128, 64))                           # the right grid for (64, 64) only


def test_fp8_deepseek_v3_checkpoint_through_transformers():
    """A tiny DeepSeek-V3 folder in FP8 ([8, 16] blocks: transformers' loader needs whole blocks): the
    engine's weights are transformers' dequantized parameters bit for bit, and the logits pass the gate
    against transformers float32 on that folder (and differ from the unquantized model's)."""
    import torch

    src = tiny_model_path("deepseek_v3")
    path = fp8_folder(src, src + "-fp8", (8, 16))
    model, hf = load_model(path), hf_model(path)
    at, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    want = {"layers.1.q_kv_a_proj": torch.cat([at.q_a_proj.weight, at.kv_a_proj_with_mqa.weight]),
            "layers.1.q_b_proj": at.q_b_proj.weight, "layers.1.kv_b_proj": at.kv_b_proj.weight,
            "layers.1.experts_gate_up_proj": mlp.experts.gate_up_proj,
            "layers.1.experts_down_proj": mlp.experts.down_proj,
            "layers.1.shared_down_proj": mlp.shared_experts.down_proj.weight,
            "layers.0.gate_up_proj": torch.cat([hf.model.layers[0].mlp.gate_proj.weight,
                                                hf.model.layers[0].mlp.up_proj.weight])}
    for name, t in want.items():
        np.testing.assert_array_equal(np.asarray(model.weights[name], np.float32), t.detach().numpy(), err_msg=name)
    prompts = test_prompts(model.tokenizer, 3)
    got = engine_logits(new_executor(model), prompts, prefill=4, chunks=3)
    assert not gate_failures(got, [hf_logits(path, p) for p in prompts])
    assert gate_failures(got, [hf_logits(src, p) for p in prompts])


def test_int4_unpacking_matches_a_bitwise_packer():
    rng = np.random.default_rng(2)
    q = rng.integers(-8, 8, (5, 72)).astype(np.int8)
    q[0, :16] = np.arange(-8, 8)
    packed = pack_int32_bitwise(q, 4)
    assert packed.dtype == np.int32 and packed.shape == (5, 9)
    np.testing.assert_array_equal(unpack_int32(packed, 4, 72), q)
    words = packed.view(np.uint32)
    assert words[0, 0] == sum(((v + 8) & 0xF) << (4 * k) for k, v in enumerate(range(-8, 0)))
    nibbles_reversed = sum(((words >> np.uint32(4 * k)) & np.uint32(0xF)) << np.uint32(4 * (7 - k)) for k in range(8))
    assert not np.array_equal(unpack_int32(nibbles_reversed.astype(np.uint32).view(np.int32), 4, 72), q)


def test_int4_group_dequantization_and_a_wrong_group_order():
    """w = q · scale[n, k // 32] in the scale's dtype (bf16, as compressed-tensors multiplies); scales
    applied per row-group instead, or with groups interleaved, differ."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 128)).astype(np.float32)
    q, scale, deq = quantize_int_group(w, 4, 32)
    got = dequant_packed_group(pack_int32_bitwise(q, 4), scale, (6, 128), 4, 32)
    np.testing.assert_array_equal(got, deq)
    np.testing.assert_array_equal(got, (q * np.repeat(scale.astype(np.float32), 32, -1)).astype(ml_dtypes.bfloat16))
    assert np.abs(got - w).max() < 0.5 * np.abs(w).max() / 7 + 1e-6
    interleaved = np.tile(scale.astype(np.float32), 32)                    # group of column k: k % 4
    assert not np.array_equal(got, (q * interleaved).astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match="needs scales"):
        dequant_packed_group(pack_int32_bitwise(q, 4), scale.T.copy(), (6, 128), 4, 32)


def test_int4_against_compressed_tensors_when_installed():
    torch = pytest.importorskip("torch")
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    rng = np.random.default_rng(4)
    q = rng.integers(-8, 8, (7, 96)).astype(np.int8)
    packed = helpers.pack_to_int32(torch.from_numpy(q), 4).numpy()
    np.testing.assert_array_equal(packed, pack_int32_bitwise(q, 4))
    np.testing.assert_array_equal(unpack_int32(packed, 4, 96), q)


def test_int4_kimi_k2_experts_checkpoint():
    """A tiny Kimi-K2 folder with int4 routed experts loads to exactly the dequantized weights and passes the
    gate against transformers float32 on those weights (in a bf16 folder: they are exact in bf16)."""
    src = tiny_model_path("kimi_k2")
    path, reference = int4_experts_folder(src, src + "-int4", src + "-int4-ref", group=32)
    model, ref = load_model(path), load_model(reference)
    assert set(model.weights) == set(ref.weights)
    for name in model.weights:
        np.testing.assert_array_equal(np.asarray(model.weights[name], np.float32),
                                      np.asarray(ref.weights[name], np.float32), err_msg=name)
    prompts = test_prompts(model.tokenizer, 3)
    got = engine_logits(new_executor(model), prompts, prefill=4, chunks=3)
    assert not gate_failures(got, [hf_logits(reference, p) for p in prompts])
    assert gate_failures(got, [hf_logits(src, p) for p in prompts])


def test_unsupported_quantization_configs_are_refused():
    ok = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    assert quant_format({"quantization_config": ok}).group == 32
    assert quant_format({}) is None
    asym = {**ok, "config_groups": {"g": {"weights": {**ok["config_groups"]["g"]["weights"], "symmetric": False}}}}
    for bad, needle in (({"quant_method": "marlin"}, "quant_method"), ({"quant_method": "awq", "bits": 8}, "4-bit"),
                        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "act-order"),
                        ({"quant_method": "fp8"}, "weight_block_size"),
                        (asym, "symmetric=False"), ({**ok, "format": "float-quantized"}, "pack-quantized")):
        with pytest.raises(ValueError, match=needle):
            quant_format({"quantization_config": bad})


def test_fp4_experts_are_transformers_bit_for_bit():
    """DeepSeek-V4's FP4 experts in an fp8 checkpoint: int8 bytes of two e2m1 values with ue8m0 scales per
    [1, 32] block, as transformers' Fp8Dequantize reads them; swapped nibbles differ."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from engine.loader.quantized import dequant_fp4_block
    rng = np.random.default_rng(5)
    packed = rng.integers(-128, 128, (16, 48)).astype(np.int8)          # [N, K / 2]: K = 96, 3 blocks per row
    scale = rng.integers(115, 135, (16, 3)).astype(np.uint8)
    want = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(packed), torch.from_numpy(scale),
                                                 output_dtype=torch.float32).numpy()
    got = dequant_fp4_block(packed, scale.view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(got, want)
    swapped = ((packed.view(np.uint8) >> 4) | (packed.view(np.uint8) << 4)).astype(np.uint8)
    assert not np.array_equal(dequant_fp4_block(swapped, scale.view(ml_dtypes.float8_e8m0fnu)), want)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_the_benchmark_checkpoint_writer(fmt, tmp_path):
    """bench/deepseek_weights.py (run here on the CPU at a small width) writes a checkpoint the loader reads in
    that format: the quantized tensors are there, and the dequantized weights are near the bf16 reference
    draw (int4: within half a step of each group's scale; fp8: e4m3's relative precision)."""
    import json

    from bench.deepseek_weights import write_random_quantized
    from engine.loader.safetensors_io import SafetensorsCheckpoint
    with open(f"{tiny_model_path('kimi_k2')}/config.json") as f:
        cfg = json.load(f)
    cfg.update(hidden_size=128, moe_intermediate_size=64, intermediate_size=256, q_lora_rank=64, kv_lora_rank=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    folder = str(tmp_path / fmt)
    stored = write_random_quantized(str(tmp_path / "config.json"), folder, fmt, device="cpu")
    ckpt = SafetensorsCheckpoint(folder)
    expert = "model.layers.1.mlp.experts.3.down_proj."
    if fmt == "int4":
        assert ckpt.get(expert + "weight_packed").dtype == np.int32 and expert + "weight" not in ckpt
    else:
        assert ckpt.get(expert + "weight").dtype == ml_dtypes.float8_e4m3fn and expert + "weight_scale_inv" in ckpt
    model = load_model(folder)
    down = np.asarray(model.weights["layers.1.experts_down_proj"])[3]
    assert down.shape == (128, 64) and 0.05 < down.std() < 0.3 and stored[expert + "weight"] > 0
    logits = new_executor(model).forward_logits(ModelBatch.build([SeqStep(0, [1, 2, 3], 0, [0], False)]))
    assert np.isfinite(logits).all()


def tiny_v4_config(tmp_path) -> str:
    """DeepSeek-V4-Flash's benchmark config cut to 4 layers (bench/decode.py config_path: sliding, sliding,
    compressed-sparse, heavily-compressed; 3 hash-routed MLPs, then 1 score-routed; yarn on the compressed layers'
    rope) at a small width, with entries of 8 tokens on the heavily compressed layer and a window of 6."""
    import json

    from bench.decode import config_path
    with open(config_path("deepseek-v4-flash", 4)) as f:
        cfg = json.load(f)
    cfg.update(vocab_size=4096, hidden_size=128, moe_intermediate_size=64, num_attention_heads=4, head_dim=64,
               q_lora_rank=64, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=3,
               n_routed_experts=8, num_experts_per_tok=2, sliding_window=6, hc_mult=3,
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "config.json")


def test_the_benchmark_v4_checkpoint_writer(tmp_path):
    """bench/deepseek_weights.py's DeepSeek-V4 format (run here on the CPU at a small width): FP8 projections with
    ue8m0 block scales, FP4 experts (int8 bytes, ue8m0 scales per [1, 32]), float32 hyper-connections, an int32
    tid2eid of distinct experts; the sizes it reports are the planned ones; the loader reads it, and the engine's
    logits on it pass the gate against transformers float32 on the same weights dequantized (exact values)."""
    from bench.deepseek_weights import planned_bytes, write_random_quantized
    from engine.loader.quantized import FP4_E2M1
    from engine.loader.safetensors_io import SafetensorsCheckpoint
    from engine.models.quant_experts import W4Experts
    from harness.models import random_sequences
    from harness.quantized import dequantized_copy

    config, folder = tiny_v4_config(tmp_path), str(tmp_path / "fp8")
    stored = write_random_quantized(config, folder, "fp8", device="cpu")
    assert stored == planned_bytes(config, "fp8")
    ckpt = SafetensorsCheckpoint(folder)
    e8m0 = ml_dtypes.float8_e8m0fnu
    expert, wq_b = "model.layers.3.ffn.experts.5.w2.", "model.layers.2.attn.wq_b."
    packed, scale = ckpt.get(expert + "weight"), ckpt.get(expert + "weight_scale_inv")
    assert packed.dtype == np.int8 and packed.shape == (128, 32) and scale.dtype == e8m0 and scale.shape == (128, 2)
    assert ckpt.get(wq_b + "weight").dtype == ml_dtypes.float8_e4m3fn
    assert ckpt.get(wq_b + "weight_scale_inv").dtype == e8m0 and ckpt.get(wq_b + "weight_scale_inv").shape == (2, 1)
    for name, dtype in (("model.layers.2.attn.compressor.wkv.weight", ml_dtypes.bfloat16),
                        ("model.layers.0.hc_attn_fn", np.float32), ("model.hc_head.hc_scale", np.float32),
                        ("model.layers.3.ffn.gate.bias", np.float32), ("model.layers.2.attn.attn_sink", np.float32)):
        assert ckpt.get(name).dtype == dtype, name
    tid2eid = np.asarray(ckpt.get("model.layers.1.ffn.gate.tid2eid"))
    assert tid2eid.dtype == np.int32 and tid2eid.shape == (4096, 2) and tid2eid.min() >= 0 and tid2eid.max() < 8
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()
    model = load_model(folder)
    kept = model.weights["layers.3.experts_down_proj"]
    assert isinstance(kept, W4Experts) and kept.w4.fp4 and kept.w4.group == 32     # the FP4 experts kept packed
    down = np.asarray(kept, np.float32)[5]
    steps = down.reshape(128, 2, 32) / np.asarray(scale, np.float32)[..., None]
    assert np.isin(steps, FP4_E2M1).all()                                 # e2m1 values times a power of two
    amax = np.abs(steps).max(-1)
    assert ((amax >= 3) & (amax <= 6)).all()             # the least power of two that fits (amax in (3, 6], rounded)
    assert 0.08 < down.std() < 0.2                                        # N(0, 1/64), rounded to e2m1
    seqs = random_sequences(4096, [40, 23], seed=0)
    got = engine_logits(new_executor(model), seqs, prefill=5, chunks=3)
    assert all(np.isfinite(g).all() for g in got)
    oracle = dequantized_copy(folder, str(tmp_path / "ref"))
    assert not gate_failures(got, [hf_logits(oracle, s) for s in seqs])


def test_fp4_packer_rounds_to_the_nearest_e2m1_value():
    """bench/deepseek_weights.py's FP4 packing against a brute-force nearest e2m1 value per element, read back
    through the loader's unpacking."""
    torch = pytest.importorskip("torch")
    from bench.deepseek_weights import _fp4_block
    from engine.loader.quantized import FP4_E2M1, dequant_fp4_block
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(7)) * 0.1
    packed, scale = _fp4_block(w)
    s = np.repeat(np.asarray(scale, np.float32), 32, axis=-1)
    x = w.numpy() / s
    want = FP4_E2M1[:8][np.abs(np.abs(x)[..., None] - FP4_E2M1[:8]).argmin(-1)] * np.sign(x)
    np.testing.assert_array_equal(dequant_fp4_block(packed, scale) / s, want)


def test_the_v4_benchmark_config_at_real_width_fits_one_h200():
    """DeepSeek-V4-Flash's benchmark config cut to 4 layers keeps each attention kind and both MLP kinds, and its
    checkpoint (fp8 + fp4 experts) fits the 64 GB disk of a one-GPU host and, dequantized to bf16, the H200."""
    from bench.decode import config_path
    from bench.deepseek_weights import planned_bytes
    from engine.model_config import ModelConfig
    from engine.models.registry import build_model

    path = config_path("deepseek-v4-flash", 4)
    model = build_model(ModelConfig.from_file(path))
    assert [s.rate for s in model.attention_specs] == [0, 0, 4, 128] and model.attention_specs[2].index_heads == 64
    assert model.v4.mlp_layer_types == ("hash_moe", "hash_moe", "hash_moe", "moe")
    assert (model.config.hidden_size, model.v4.experts, model.v4.top_k, model.v4.moe_inter) == (4096, 256, 6, 2048)
    model.check_gpu_shapes()
    params = sum(int(np.prod(s)) for spec in model.weight_specs() for _, s in spec.parts)
    stored = sum(planned_bytes(path, "fp8").values())
    print(f"deepseek-v4-flash, 4 layers: {params / 1e9:.2f} G parameters, stored {stored / 1e9:.2f} GB, "
          f"bf16 {2 * params / 1e9:.2f} GB")
    assert stored < 40e9 and 2 * params < 100e9
