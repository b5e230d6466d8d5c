"""moe_route.cu (the router's top-k: softmax, sigmoid or sqrtsoftplus scores, DeepSeek-V3's / V4's score
correction bias, group-limited by the best score or the top-2 sum) run through GpuMoEOps.route_logits on the
host, without a GPU (tests/cuda_emulation.h, as test_deltanet_kernels_emulated), against the numpy router
(cpu_moe_ops.route_topk): the same ids, weights to float32 rounding. Skipped without g++ or the CUDA headers."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.executor.cpu_moe_ops import route_topk
from engine.executor.gpu_moe_ops import COMBINE_COLS, MOE_UNROLL, GpuMoEOps
from engine.models.ops import RouteSpec
from test_deltanet_kernels_emulated import EmulatedShared, host

SPECS = [RouteSpec(6, 3, renormalize=True), RouteSpec(6, 2, scale=1.5),                       # Qwen3-MoE, V2-Lite
         RouteSpec(6, 3, num_groups=3, topk_groups=2),                                      # V2 group-limited
         RouteSpec(8, 3, renormalize=True, scale=2.5, num_groups=4, topk_groups=2, scoring="sigmoid"),   # V3
         RouteSpec(384, 8, renormalize=True, scale=2.827, scoring="sigmoid"),               # Kimi-K2
         RouteSpec(256, 8, renormalize=True, scale=2.5, num_groups=8, topk_groups=4, scoring="sigmoid"),  # V3
         RouteSpec(256, 6, renormalize=True, scale=1.5, scoring="sqrtsoftplus")]                   # V4-Flash


class EmulatedMoE(GpuMoEOps):
    def __init__(self, tokens: int, spec: RouteSpec):
        self.shared = EmulatedShared()
        self.route_max_e = 32 * -(-spec.num_experts // 32)         # built per model, as GpuMoEOps does
        self.k_topk = ("moe_route", "moe_topk", (("MAX_E", self.route_max_e),))
        self.k_route_gemv = ("moe_route", "moe_route_gemv", (("MAX_E", self.route_max_e),))
        self.buf = {"moe_weights": host(np.zeros(tokens * spec.top_k, np.float32)),
                    "moe_ids": host(np.zeros(tokens * spec.top_k, np.int32)),
                    "moe_logits": host(np.zeros(tokens * spec.num_experts, np.float32)),
                    "moe_counter": host(np.zeros(1, np.int32))}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"E{s.num_experts}k{s.top_k}g{s.num_groups}{s.scoring}")
@pytest.mark.parametrize("biased", [False, True])
def test_router_kernel_matches_numpy(spec, biased):
    if biased and spec.scoring == "softmax":
        pytest.skip("the correction bias is DeepSeek-V3's and V4's (sigmoid, sqrtsoftplus scores)")
    T, E = 9, spec.num_experts
    rng = np.random.default_rng(E + biased)
    logits = rng.standard_normal((T, E)).astype(np.float32) * 2
    bias = (0.1 * rng.standard_normal(E)).astype(ml_dtypes.bfloat16) if biased else None
    ops = EmulatedMoE(T, spec)
    weights, ids = ops.route_logits(host(logits), spec, host(bias.view(np.uint16)) if biased else None)
    want_w, want_ids = route_topk(logits, spec, None if bias is None else bias.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(ids).reshape(T, -1), want_ids)
    np.testing.assert_allclose(np.asarray(weights).reshape(T, -1), want_w, rtol=2e-6, atol=1e-7)
    if biased:       # the check can fail: the bias moves the choice
        assert not np.array_equal(route_topk(logits, spec)[1], want_ids)


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2], SPECS[4], SPECS[5], SPECS[6]],
                         ids=lambda s: f"E{s.num_experts}k{s.top_k}g{s.num_groups}{s.scoring}")
@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_one_launch_router_matches_numpy(spec, tokens):
    """moe_route_gemv (GpuMoEOps.route of a decode step: the router product and the top-k in one launch,
    the last CTA routing) against the float32 product of the same bf16 values and the numpy router; run
    twice, as a graph replays it: its finishing counter is back at zero after each launch."""
    E, H = spec.num_experts, 72
    rng = np.random.default_rng(E + tokens)
    x = rng.standard_normal((tokens, H)).astype(ml_dtypes.bfloat16)
    router = (rng.standard_normal((E, H)) / 4).astype(ml_dtypes.bfloat16)
    bias = (0.1 * rng.standard_normal(E)).astype(ml_dtypes.bfloat16) if spec.scoring == "sigmoid" else None
    ops = EmulatedMoE(tokens, spec)
    ops.route_gemv_tokens = 8                           # the kernel's limit (the default takes fewer)
    want_logits = x.astype(np.float32) @ router.astype(np.float32).T
    want_w, want_ids = route_topk(want_logits, spec, None if bias is None else bias.astype(np.float32))
    for _ in range(2):
        weights, ids = ops.route(host(x.view(np.uint16)), host(router.view(np.uint16)), spec,
                                 None if bias is None else host(bias.view(np.uint16)))
        np.testing.assert_allclose(np.asarray(ops.buf["moe_logits"]).reshape(tokens, E), want_logits, rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_array_equal(np.asarray(ids).reshape(tokens, -1), want_ids)
        np.testing.assert_allclose(np.asarray(weights).reshape(tokens, -1), want_w, rtol=1e-5, atol=1e-6)
        assert int(ops.buf["moe_counter"][0]) == 0
        ops.buf["moe_ids"][:] = -7                      # the second launch must write them again


def test_router_drops_the_slots_of_a_nan_row():
    """A row of NaN logits (a padded row of a piecewise graph holds whatever the ring held) routes to id -1
    with weight 0 in every slot, which the expert kernels drop; the other rows route as numpy does."""
    spec = RouteSpec(6, 3, renormalize=True)
    logits = np.random.default_rng(3).standard_normal((3, 6)).astype(np.float32)
    logits[1] = np.nan
    ops = EmulatedMoE(3, spec)
    weights, ids = ops.route_logits(host(logits), spec)
    ids, weights = np.asarray(ids).reshape(3, -1), np.asarray(weights).reshape(3, -1)
    np.testing.assert_array_equal(ids[1], [-1, -1, -1])
    want_w, want_ids = route_topk(logits[[0, 2]], spec)
    np.testing.assert_array_equal(ids[[0, 2]], want_ids)
    np.testing.assert_allclose(weights[[0, 2]], want_w, rtol=2e-6)


def test_router_kernel_compiles_with_nvcc_for_sm90a(tmp_path):
    """The device build the GPU runs (NVRTC there; nvcc here, where NVRTC's Python binding is missing)."""
    import os
    import shutil
    import subprocess

    from openinfer_kernels.raw_cuda import KERNEL_DIR
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not available")
    subprocess.run([nvcc, "-arch=sm_90a", "-c", os.path.join(KERNEL_DIR, "moe_route.cu"), "-o", str(tmp_path / "k.o")],
                   check=True, capture_output=True)


class ExpertsShared(EmulatedShared):
    """The residual stream: one host buffer."""

    def __init__(self, tokens: int, hidden: int):
        self.residual = host(np.zeros((tokens, hidden), np.uint16))

    def residual_out(self, rows: int, cols: int):
        return self.residual


class EmulatedExperts(GpuMoEOps):
    """experts() of a decode-sized step on the host: moe_align, the gather, moe_gemv.cu for both products,
    silu_mul.cu and the weighted combine, each through the emulation."""

    def __init__(self, tokens: int, spec: RouteSpec, hidden: int, inter: int):
        from types import SimpleNamespace

        from memory.device_arena import Buffer

        plan = SimpleNamespace(max_tokens=tokens, experts=SimpleNamespace(
            num_experts=spec.num_experts, top_k=spec.top_k, hidden=hidden, inter=inter))
        self.shared = ExpertsShared(tokens, hidden)
        self.buf = {b.name: host(np.zeros(b.shape, b.dtype)) for b in self.buffers(plan)
                    if isinstance(b, Buffer)}
        for name, entry in (("align", "moe_align"), ("gather", "moe_gather"), ("combine", "moe_combine"),
                            ("gemv", "moe_gemv"), ("gemv_silu", "moe_gemv_silu"), ("gemv_combine", "moe_gemv_combine")):
            file = {"gather": "moe_permute", "combine": "moe_permute"}.get(name, entry if name != "gemv_silu"
                                                                           and name != "gemv_combine" else "moe_gemv")
            gemv = (("COMBINE_COLS", COMBINE_COLS), ("MOE_UNROLL", MOE_UNROLL)) if file == "moe_gemv" else ()
            setattr(self, f"k_{name}", (file, entry, gemv))
        self.k_silu = ("silu_mul", "silu_mul", ())


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_decode_experts_on_the_gemv_match_numpy(tokens):
    """GpuMoEOps.experts for a step of at most GEMV_MAX_TOKENS tokens (experts shared between tokens
    included) against NumpyMoEOps on the same bf16 values, to bf16 rounding of the intermediate rows."""
    from engine.executor.cpu_moe_ops import NumpyMoEOps
    from engine.executor.cpu_ops import NumpyOps
    from engine.executor.gpu_moe_ops import GEMV_MAX_TOKENS

    assert tokens <= GEMV_MAX_TOKENS
    spec, H, inter = RouteSpec(6, 3, renormalize=True), 64, 48
    rng = np.random.default_rng(tokens)
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    x, residual = bf(rng.standard_normal((tokens, H))), bf(rng.standard_normal((tokens, H)))
    gate_up, down = bf(rng.standard_normal((6, 2 * inter, H)) / 8), bf(rng.standard_normal((6, H, inter)) / 7)
    weights, ids = route_topk(rng.standard_normal((tokens, 6)).astype(np.float32), spec)
    ops = EmulatedExperts(tokens, spec, H, inter)
    got = ops.experts(host(x.view(np.uint16)), host(gate_up.view(np.uint16)), host(down.view(np.uint16)),
                      host(weights.astype(np.float32)), host(ids.astype(np.int32)), host(residual.view(np.uint16)))
    got = np.asarray(got).view(ml_dtypes.bfloat16).astype(np.float32)

    numpy = NumpyOps(np.zeros(1), frozenset({"moe"}))
    assert isinstance(numpy.moe, NumpyMoEOps)
    want = numpy.moe.experts(*(np.asarray(v, np.float32) for v in (x, gate_up, down)), weights, ids,
                             residual.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)
    assert np.abs(got - want).mean() < 5e-3


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("interleaved", [False, True])
def test_ungrouped_experts_equal_the_grouped_path(tokens, interleaved):
    """The experts of a step of at most FUSED_MAX_TOKENS tokens without the grouping (moe_gemv_silu +
    moe_gemv_combine: two launches) give the same bits as the grouped decode path (moe_align, gather,
    moe_gemv, silu_mul, moe_gemv, combine), in both gate_up layouts, with an expert shared by two tokens
    and an assignment of another rank (id -1) skipped by both."""
    from engine.executor.gpu_gemm import interleave_gate_up
    from engine.executor.gpu_moe_ops import FUSED_MAX_TOKENS

    assert tokens <= FUSED_MAX_TOKENS
    spec, H, inter = RouteSpec(7, 3, renormalize=True), 264, 48
    rng = np.random.default_rng(10 * tokens + interleaved)
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)  # noqa: E731
    x, residual = bf(rng.standard_normal((tokens, H))), bf(rng.standard_normal((tokens, H)))
    gate_up, down = rng.standard_normal((7, 2 * inter, H)) / 8, bf(rng.standard_normal((7, H, inter)) / 7)
    gate_up = bf(interleave_gate_up(gate_up) if interleaved else gate_up)
    weights, ids = route_topk(rng.standard_normal((tokens, 7)).astype(np.float32), spec)
    ids = ids.astype(np.int32)
    if tokens > 1:
        ids[1, 0] = ids[0, 0]                           # two tokens on one expert
        ids[tokens - 1, 2] = -1                         # another rank's expert
    outs = []
    for fused in (0, tokens):
        ops = EmulatedExperts(tokens, spec, H, inter)
        ops.shared.gate_up_interleaved, ops.fused_tokens = interleaved, fused
        got = ops.experts(host(x), host(gate_up), host(down), host(weights.astype(np.float32)), host(ids),
                          host(residual))
        outs.append(np.array(got))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.any(outs[0] != residual)
