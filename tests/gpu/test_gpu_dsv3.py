"""GPU accuracy gate of the DeepSeek-V3 / Kimi-K2 line (tiny models of harness DSV3_MODELS) by the DESIGN.md
floor method, as test_gpu_moe_mla runs it for the MoE / MLA lines (HF float32 the oracle, HF bf16 vs float32
the floor): prefill, decode, chunked prefill, each GEMM library, batch 1 twice bit-identical, batched ==
batch 1, mixed steps, CUDA-graph buckets vs eager, a prefix-cache hit, the MLA forms against each other.
Plus the router kernel on the device (sigmoid + bias + groups) against numpy, and the quantized formats
on the GPU (dequantized at load, uploaded as bf16) against transformers on the dequantized weights.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import test_gpu_moe_mla as moe_mla
from engine.executor.cpu_moe_ops import route_topk
from engine.loader import load_model
from harness.executors import new_gpu_executor
from harness.models import DSV3_MODELS, engine_logits, random_sequences, tiny_model_path
from harness.quantized import dequantized_copy, fp8_folder, int4_experts_folder
from test_gpu_executor import (assert_gate, gate_row, hf_gpu_models, hf_run, test_tiny_batch1_deterministic,  # noqa: F401
                               test_tiny_batched_equals_batch1, test_tiny_gate, test_tiny_gate_gemm_library)
from test_gpu_moe_mla import test_tiny_mixed_steps_gate  # noqa: F401

pytestmark = pytest.mark.gpu
NAMES = sorted(DSV3_MODELS)


@pytest.fixture(scope="module", params=NAMES)
def tiny(request):
    yield from moe_mla.tiny_case(request.param)


@pytest.mark.parametrize("name", NAMES)
def test_graph_decode_matches_eager_in_every_bucket(name):
    moe_mla.test_graph_decode_matches_eager_in_every_bucket(name)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hit_equals_full_prefill(name):
    moe_mla.test_prefix_hit_equals_full_prefill(name)


@pytest.mark.parametrize("name", NAMES)
def test_mla_expanded_prefill_equals_absorbed(name):
    moe_mla.test_mla_expanded_prefill_equals_absorbed(name)


def test_biased_sigmoid_router_on_the_device_matches_numpy():
    import cupy

    from test_gpu_moe_mla_kernels import dev, executor, host
    model, ex = executor("deepseek_v3")
    spec = model.model.mla.route
    rng = np.random.default_rng(0)
    x, gate = dev(rng.standard_normal((37, 64))), dev(rng.standard_normal((spec.num_experts, 64)) / 4)
    bias = (0.1 * rng.standard_normal(spec.num_experts)).astype(ml_dtypes.bfloat16)
    weights, ids = ex.ops.moe.route(x, gate, spec, cupy.asarray(bias.view(np.uint16)))
    logits = cupy.asnumpy(ex.ops.moe.buf["moe_logits"][:37 * spec.num_experts]).reshape(37, -1)
    np.testing.assert_allclose(logits, host(x) @ host(gate).T, rtol=1e-4, atol=1e-4)
    want_w, want_ids = route_topk(logits, spec, bias.astype(np.float32))
    np.testing.assert_array_equal(cupy.asnumpy(ids), want_ids)
    np.testing.assert_allclose(cupy.asnumpy(weights), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_checkpoint_gate(fmt):
    """An FP8 DeepSeek-V3 / int4-expert Kimi-K2 folder on the GPU (dequantized at load) against HF float32 /
    bf16 on the same weights, dequantized (the floor method)."""
    if fmt == "fp8":
        src = tiny_model_path("deepseek_v3")
        path = fp8_folder(src, src + "-fp8-gpu", (8, 16))
        oracle = dequantized_copy(path, path + "-ref")
    else:
        src = tiny_model_path("kimi_k2")
        path, oracle = int4_experts_folder(src, src + "-int4-gpu", src + "-int4-gpu-ref")
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [64, 29], seed=3)
    m32, m16 = hf_gpu_models(oracle)
    o32, o16 = [hf_run(m32, s) for s in seqs], [hf_run(m16, s) for s in seqs]
    del m32, m16
    ex = new_gpu_executor(model)
    assert_gate(gate_row(f"{fmt}/chunked", engine_logits(ex, seqs, prefill=5, chunks=[1, 7]), o32, o16))
    ex.close()
