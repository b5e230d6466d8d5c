"""FP8 W8A8 on the GPU executor (engine/executor/gpu_fp8_ops.py), tiny Qwen3 / Llama folders in both FP8 formats
(harness.quant_models.py), by the floor method against transformers on the dequantized weights with each
projection's input quantized as the kernels do (e4m3 per token and 128-group, harness.quant_models.with_w8a8_hooks):
HF float32 is the oracle, HF bf16 (the same hooks) the floor: argmax by regret and mean |Δlogprob| within
tests/gpu/test_gpu_executor.py's rule (max(0.02, 2 x the floor's mean)). Every KV path (one prefill, prefill then
decode rows, chunks) runs decode rows through gemv_fp8 / gemv_w4 and larger steps through the CuTe FP8 GEMM (or, with
--gemm cublas, the GEMV 16 rows at a time) / w4_dequant + the bf16 GEMM; CUDA-graph decode gives eager greedy's
tokens (a flip only inside a tie).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.loader import load_model
from harness.executors import new_gpu_executor
from harness.quant_models import fp8_tiny, int4_tiny, with_w8a8_hooks
from harness.models import engine_logits, random_sequences
from test_gpu_executor import GPU_CPU_TIE_TOL, PATHS, assert_gate, assert_same_or_tie, gate_row, greedy, hf_run

pytestmark = pytest.mark.gpu
CASES = [("qwen3", "block"), ("qwen3", "channel"), ("llama", "block"), ("qwen3", "awq"), ("qwen3", "gptq")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def fp8_case(request):
    import torch
    from transformers import AutoModelForCausalLM

    line, fmt = request.param
    int4 = fmt in ("awq", "gptq")
    path, ref = int4_tiny(line, fmt) if int4 else fp8_tiny(line, fmt)
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=1)
    oracle = []
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, attn_implementation="eager")
        hf = hf if int4 else with_w8a8_hooks(hf)
        oracle.append([hf_run(hf.cuda().eval(), s) for s in seqs])
        del hf
    return "-".join(request.param), model, seqs, oracle[0], oracle[1]


@pytest.mark.parametrize("gemm", ["auto", "cublas"])
def test_quantized_gate(fp8_case, gemm):
    from engine.executor.gpu_fp8_ops import Fp8Device
    from openinfer_kernels.quant.ops import W4Weight
    name, model, seqs, o32, o16 = fp8_case
    ex = new_gpu_executor(model, gemm=gemm)
    try:
        kept = [n for n, w in ex.weights.items() if isinstance(w, (Fp8Device, W4Weight))]
        assert len(kept) == 4 * model.config.num_hidden_layers, kept
        assert all(ex.weights[n].codes.dtype in (np.uint8, np.uint32) for n in kept)
        for path_name in sorted(PATHS):
            assert_gate(gate_row(f"fp8/{name}/{gemm}/{path_name}", engine_logits(ex, seqs, **PATHS[path_name]),
                                 o32, o16))
    finally:
        ex.close()


def test_graph_decode_equals_eager(fp8_case):
    name, model, seqs, _, _ = fp8_case
    assert_graphs_equal_eager(model, seqs, f"fp8/{name}")


def assert_graphs_equal_eager(model, seqs: list[list[int]], what: str) -> None:
    """CUDA-graph greedy decode of the sequences' first 20 tokens gives eager's 24 tokens (a flip only in a tie)."""
    prompts = [s[:20] for s in seqs]
    eager, graphed = new_gpu_executor(model, cuda_graphs=False), new_gpu_executor(model)
    try:
        want, got = greedy(eager, prompts, 24), greedy(graphed, prompts, 24)
        for p, a, b in zip(prompts, got, want):
            assert_same_or_tie(eager, p, a, b, GPU_CPU_TIE_TOL, f"{what} graphs vs eager")
    finally:
        eager.close()
        graphed.close()
