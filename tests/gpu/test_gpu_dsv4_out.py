"""DeepSeek-V4's grouped output projection on the device (GpuDSV4Ops.grouped_linear over a tiny DeepSeek-V4
executor's MoE part: moe_gemv.cu up to GEMV_MAX_TOKENS tokens, then the CuTe grouped GEMM or moe_grouped_gemm.cu)
against the numpy definition: the cases and bound of tests/dsv4_out_cases.py, V4-Flash's whole (the host
emulation cuts it), plus a replay of the op captured in a CUDA graph on new activations."""
from __future__ import annotations

import pytest
from dsv4_out_cases import CASES, TOKENS, check, random_inputs, reference, run
from test_gpu_moe_mla_kernels import executor

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def back(a):
    cp.cuda.get_current_stream().synchronize()
    return cp.asnumpy(a)


def dsv4_ops(gemm: str):
    """The DeepSeek-V4 part of a tiny executor whose GEMM library is `gemm` (its stream the current one)."""
    _, ex = executor("deepseek_v4", gemm)
    if gemm == "cute" and ex.gemm.cute is None:
        pytest.skip(f"CuTe GEMM not available: {ex.gemm.cute_missing}")
    return ex.ops.dsv4


@pytest.mark.parametrize("gemm", ["cute", "cublas"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_grouped_projection_matches_numpy_on_the_device(case, gemm):
    ops = dsv4_ops(gemm)
    for tokens in TOKENS:
        inp = random_inputs(*case[1:], tokens, seed=tokens)
        check(run(ops, inp, cp.asarray, back), reference(inp))


@pytest.mark.parametrize("tokens", [3, 32])
def test_a_captured_graph_replays_the_grouped_projection(tokens):
    """grouped_linear captured once at V4-Flash's width (moe_gemv.cu at 3 tokens, the grouped GEMM at 32; the
    layout made on the device, the temporaries from the captures' pool as the decode graphs take them), replayed
    on new activations written into the captured input: each replay matches the numpy product of its inputs."""
    from engine.executor.gpu_graphs import capture_memory, capture_mode

    ops = dsv4_ops("auto")
    inp = random_inputs(*CASES[1][1:], tokens, seed=1)
    x, w, stream = cp.asarray(inp.x), cp.asarray(inp.w), ops.shared.stream
    with capture_memory(ops.shared):
        ops.grouped_linear(x, w, inp.groups)                     # compiled, the pool's blocks there
        stream.synchronize()
        stream.begin_capture(*capture_mode())
        out = ops.grouped_linear(x, w, inp.groups)
        graph = stream.end_capture()
    for seed in (2, 3):
        new = random_inputs(*CASES[1][1:], tokens, seed=seed)
        new.w = inp.w
        x.set(new.x, stream)
        graph.launch(stream)
        check(back(out), reference(new))
