"""Routed experts kept quantized on the GPU executor (engine/executor/gpu_quant_moe.py): tiny MoE folders with FP8
block-scaled experts (Qwen3-MoE, which keeps its attention and dense MLP in FP8 too, and DeepSeek-V3:
harness.quant_models.fp8_moe_tiny) and Kimi-K2-Thinking-style int4 experts (compressed-tensors pack-quantized, group
32), by the floor method against transformers on the dequantized weights (FP8: each kept product's input quantized as
the kernels do, harness.quant_models.with_w8a8_experts / with_w8a8_hooks): HF float32 the oracle, HF bf16 (the same
quantization) the floor, tests/gpu/test_gpu_executor.py's rule. The experts are on the device kept (uint8 e4m3 codes +
float32 scales, the W4 packed layout), every KV path (one prefill, prefill then decode rows, chunks) runs them on
gemv_fp8_grouped / gemv_w4_grouped, and CUDA-graph decode gives eager greedy's tokens (a flip only inside a tie).
DeepSeek-V4's FP4 experts (eager steps only) against the dequantized folder.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_gpu_executor import PATHS, assert_gate, gate_row, hf_run
from test_gpu_quantized_linear import assert_graphs_equal_eager

from engine.loader import load_model
from harness.executors import new_gpu_executor
from harness.models import engine_logits, random_sequences, tiny_model_path
from harness.quant_models import fp8_moe_tiny, with_w8a8_moe
from harness.quantized import int4_experts_folder

pytestmark = pytest.mark.gpu
CASES = [("qwen3_moe", "fp8"), ("deepseek_v3", "fp8"), ("kimi_k2", "int4")]


def folder(line: str, fmt: str) -> tuple[str, str]:
    if fmt == "fp8":
        return fp8_moe_tiny(line)
    src = tiny_model_path(line)
    return int4_experts_folder(src, src + "-int4-gpu", src + "-int4-gpu-ref", group=32)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def experts_case(request):
    import torch
    from transformers import AutoModelForCausalLM

    line, fmt = request.param
    path, ref = folder(line, fmt)
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=1)
    oracle = []
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, attn_implementation="eager")
        if fmt == "fp8":
            hf = with_w8a8_moe(hf, line)
        oracle.append([hf_run(hf.cuda().eval(), s) for s in seqs])
        del hf
    return "-".join(request.param), model, seqs, oracle[0], oracle[1]


def test_kept_experts_gate(experts_case):
    from engine.executor.gpu_quant_moe import Fp8ExpertsDevice
    from openinfer_kernels.quant.ops import W4Weight
    name, model, seqs, o32, o16 = experts_case
    ex = new_gpu_executor(model)
    try:
        kept = [n for n, w in ex.weights.items() if isinstance(w, (Fp8ExpertsDevice, W4Weight)) and "experts_" in n]
        moe_layers = sum(n.endswith("experts_down_proj") for n in model.weights)
        assert moe_layers and len(kept) == 2 * moe_layers, kept
        assert all(ex.weights[n].codes.dtype in (np.uint8, np.uint32) for n in kept)
        for path_name in sorted(PATHS):
            assert_gate(gate_row(f"experts/{name}/{path_name}", engine_logits(ex, seqs, **PATHS[path_name]), o32, o16))
    finally:
        ex.close()


def test_graph_decode_equals_eager(experts_case):
    name, model, seqs, _, _ = experts_case
    assert_graphs_equal_eager(model, seqs, f"experts/{name}")


def test_deepseek_v4_fp4_experts_gate(tmp_path):
    """The DeepSeek-V4 benchmark writer's folder (FP8 projections, FP4 experts) at a small width: the experts on the
    device as W4 packs (gemv_w4_grouped), the logits against HF float32 / bf16 on the dequantized folder."""
    from test_gpu_executor import hf_gpu_models
    from test_quantized_weights import tiny_v4_config

    from bench.deepseek_weights import write_random_quantized
    from harness.quantized import dequantized_copy
    from openinfer_kernels.quant.ops import W4Weight

    folder_path = str(tmp_path / "fp8")
    write_random_quantized(tiny_v4_config(tmp_path), folder_path, "fp8", device="cpu")
    model = load_model(folder_path)
    seqs = random_sequences(model.config.vocab_size, [40, 23], seed=0)
    m32, m16 = hf_gpu_models(dequantized_copy(folder_path, str(tmp_path / "ref")))
    o32, o16 = [hf_run(m32, s) for s in seqs], [hf_run(m16, s) for s in seqs]
    del m32, m16
    ex = new_gpu_executor(model)
    try:
        assert isinstance(ex.weights["layers.3.experts_down_proj"], W4Weight)
        assert_gate(gate_row("experts/deepseek_v4-fp4/chunked", engine_logits(ex, seqs, prefill=5, chunks=3), o32, o16))
    finally:
        ex.close()
