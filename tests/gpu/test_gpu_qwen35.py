"""The Qwen3.5 hybrid line on the GPU (needs one; the lead runs it on the H200).

Per kernel: the Gated DeltaNet GPU ops (engine/executor/gpu_deltanet_ops.py, their raw CUDA kernels)
against numpy on the cases of tests/deltanet_kernel_cases.py (the same the host emulation checks),
plain and as programmatic dependent launches.
The line: the GpuExecutor vs transformers by the floor method of tests/gpu/test_gpu_executor.py (DESIGN.md:
HF bf16 vs HF float32 measured on the same positions is the floor; argmax by regret >= 99%, mean
|Δlogprob| <= max(0.02, 2 x floor)) on the tiny hybrid models in both checkpoint forms, through
prefill (a 96-token sequence: two delta-rule chunks), prefill then decode, chunked prefill (chunks of
2: boundaries inside the conv window; and 7/16/5/9); batch-1 determinism; CUDA-graph decode (state
slots as static inputs, padded rows) == eager decode; and the real-shape Qwen3.5-4B with random bf16
weights (OPENINFER_GATE_4B=1, as for Qwen3-4B). Gate rows go to $OPENINFER_GATE_LOG like the others.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from deltanet_kernel_cases import (SHAPES, STEPS, check_conv_and_delta_rule, check_gated_rms_norm_and_sigmoid_gate,
                                   random_inputs, run_conv_and_delta_rule, spec_of)
from gpu_contention import hold_default_stream
from engine.batch import ModelBatch, SeqStep
from engine.executor.gpu_deltanet_ops import GpuDeltaNetOps
from engine.loader import load_model
from engine.request import SamplingParams
from harness.executors import new_gpu_executor
from harness.hybrid_models import HYBRID_MODELS, hybrid_model_path
from harness.models import engine_logits, random_sequences
from test_gpu_executor import PATHS as DENSE_PATHS
from test_gpu_executor import REAL_CONFIGS, assert_gate, assert_same_or_tie, gate_row, hf_run, real_shape_gate

pytestmark = pytest.mark.gpu
QWEN35_4B_CONFIG = os.path.join(REAL_CONFIGS, "qwen3.5-4b", "config.json")


# ---- per kernel ----------------------------------------------------------------------------------
class DeviceShared:
    """What the GPU op families share (gpu_shared.GpuShared): launches on one stream of their own, outputs
    fresh zeroed device arrays."""

    def __init__(self, stream, pdl: bool):
        self.stream, self.pdl = stream, pdl

    def launch(self, k, grid, block, args, shared_mem: int = 0) -> None:
        from openinfer_kernels.raw_cuda.launch import launch

        launch(k, grid, block, args, self.stream, pdl=self.pdl, shared_mem=shared_mem)

    def out(self, rows, cols):
        import cupy

        with self.stream:
            return cupy.zeros((rows, cols), cupy.uint16)


class DeviceOps(GpuDeltaNetOps):
    """The GPU ops alone: inputs, outputs and launches all on one stream of their own (an upload or a
    fill on CuPy's default stream would not be ordered before a launch on a non-blocking stream: under
    other GPU load the kernels then read inputs that had not landed yet)."""

    def __init__(self, pdl: bool = False):
        import cupy
        self.cp, self.stream = cupy, cupy.cuda.Stream(non_blocking=True)
        super().__init__(DeviceShared(self.stream, pdl), None)

    def dev(self, a):
        with self.stream:
            return self.cp.asarray(np.ascontiguousarray(a))

    def back(self, a) -> np.ndarray:
        self.stream.synchronize()
        return self.cp.asnumpy(a, stream=self.stream)


@pytest.mark.parametrize("contended", [False, True], ids=["idle", "default-stream-busy"])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("step_name", sorted(STEPS))
def test_conv_and_delta_rule_kernels(shape, step_name, pdl, contended):
    """Also with CuPy's default stream held busy: the ops must not depend on work queued there."""
    spec, step = spec_of(*shape), STEPS[step_name]
    inp = random_inputs(spec, step, num_slots=4, seed=len(step.lens))
    ops = DeviceOps(pdl)
    if contended:
        hold_default_stream()
    check_conv_and_delta_rule(spec, step, inp, run_conv_and_delta_rule(ops, spec, step, inp, ops.dev, ops.back))


def test_gated_rms_norm_and_sigmoid_gate_kernels():
    ops = DeviceOps()
    hold_default_stream()
    check_gated_rms_norm_and_sigmoid_gate(ops, spec_of(*SHAPES[2]), 4096, ops.dev, ops.back)


# ---- the line against transformers ---------------------------------------------------------------
def hf_hybrid_gpu(path: str):
    """transformers float32 and bf16 on the GPU (the composite form as Qwen3_5ForConditionalGeneration)."""
    import json

    import torch
    import transformers
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        composite = json.load(f).get("model_type") == "qwen3_5"
    auto = transformers.AutoModelForImageTextToText if composite else transformers.AutoModelForCausalLM
    return tuple(auto.from_pretrained(path, dtype=dt, attn_implementation="eager").cuda().eval()
                 for dt in (torch.float32, torch.bfloat16))


@pytest.fixture(scope="module", params=sorted(HYBRID_MODELS))
def hybrid(request):
    path = hybrid_model_path(request.param)
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=1)
    m32, m16 = hf_hybrid_gpu(path)
    o32, o16 = [hf_run(m32, s) for s in seqs], [hf_run(m16, s) for s in seqs]
    del m32, m16
    ex = new_gpu_executor(model)
    yield request.param, model, ex, seqs, o32, o16
    ex.close()


PATHS = {**DENSE_PATHS, "chunked2": dict(chunks=2, seed=4)}       # chunks of 2: boundaries inside the conv window


@pytest.mark.parametrize("path_name", sorted(PATHS))
def test_hybrid_gate(hybrid, path_name):
    name, _, ex, seqs, o32, o16 = hybrid
    assert_gate(gate_row(f"{name}/{path_name}", engine_logits(ex, seqs, **PATHS[path_name]), o32, o16))


def test_hybrid_batch1_deterministic(hybrid):
    _, _, ex, seqs, _, _ = hybrid
    assert np.array_equal(engine_logits(ex, [seqs[0]])[0], engine_logits(ex, [seqs[0]])[0])


def greedy_decode(ex, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one eager step, then decode one token a step (decode graphs where the
    executor has them); sequence i keeps its state in slot i."""
    toks = [list(p) for p in prompts]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(prompts))]
    start = [0] * len(prompts)
    for _ in range(steps):
        batch = ModelBatch.build([SeqStep(seq_id=i, token_ids=t[s:], start_pos=s, block_table=tb, sample=True,
                                          params=SamplingParams(temperature=0.0), prompt_len=len(p), history=list(t),
                                          num_generated=len(t) - len(p), state_slot=i)
                                  for i, (t, s, tb, p) in enumerate(zip(toks, start, tables, prompts))])
        out = ex.submit(batch).result()
        for i, tok in enumerate(out.sampled):
            start[i] = len(toks[i])
            toks[i].append(tok.token_id)
    return [t[len(p):] for t, p in zip(toks, prompts)]


def test_graph_decode_equals_eager_decode(hybrid):
    """Decode graphs (3 sequences padded to the bucket of 4: the padding row's slot is -1) give eager
    decode's greedy tokens, up to a flip inside a 0.02-nat tie."""
    name, model, ex, seqs, _, _ = hybrid
    prompts = [s[:n] for s, n in zip(seqs, [5, 40, 17])]
    graphs = greedy_decode(ex, prompts, 24)
    eager_ex = new_gpu_executor(model, cuda_graphs=False)
    try:
        eager = greedy_decode(eager_ex, prompts, 24)
        for p, a, b in zip(prompts, graphs, eager):
            assert_same_or_tie(eager_ex, p, a, b, 0.02, f"{name} graph vs eager")
    finally:
        eager_ex.close()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("OPENINFER_GATE_4B") != "1", reason="set OPENINFER_GATE_4B=1 (bench/gpu_suite.sh)")
def test_qwen35_4b_random_gate():
    out_dir = os.environ.get("OPENINFER_QWEN35_4B_DIR", "/tmp/qwen3.5-4b-random")
    real_shape_gate(QWEN35_4B_CONFIG, out_dir, "qwen3.5-4b-random",
                    {"prefill": {}, "decode": dict(prefill=[40, 13, 1], chunks=1),
                     "chunked": dict(chunks=[33, 7, 64], seed=3)})
