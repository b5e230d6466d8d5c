"""moe_route.cu (the router's top-k: softmax or sigmoid scores, DeepSeek-V3's score correction bias,
group-limited by the best score or the top-2 sum) run through GpuMoEOps.route_logits on the host, without a
GPU (tests/cuda_emulation.h, as test_deltanet_kernels_emulated), against the numpy router
(cpu_moe_ops.route_topk): the same ids, weights to float32 rounding. Skipped without g++ or the CUDA headers."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.executor.cpu_moe_ops import route_topk
from engine.executor.gpu_moe_ops import GpuMoEOps
from engine.models.ops import RouteSpec
from test_deltanet_kernels_emulated import EmulatedOps, host

SPECS = [RouteSpec(6, 3, renormalize=True), RouteSpec(6, 2, scale=1.5),                       # Qwen3-MoE, V2-Lite
         RouteSpec(6, 3, num_groups=3, topk_groups=2),                                      # V2 group-limited
         RouteSpec(8, 3, renormalize=True, scale=2.5, num_groups=4, topk_groups=2, scoring="sigmoid"),   # V3
         RouteSpec(384, 8, renormalize=True, scale=2.827, scoring="sigmoid"),               # Kimi-K2
         RouteSpec(256, 8, renormalize=True, scale=2.5, num_groups=8, topk_groups=4, scoring="sigmoid")]  # V3


class EmulatedMoE(GpuMoEOps, EmulatedOps):
    def __init__(self, tokens: int, spec: RouteSpec):
        self.k_topk = ("moe_route", "moe_topk", ())
        self.moe = {"moe_weights": host(np.zeros(tokens * spec.top_k, np.float32)),
                    "moe_ids": host(np.zeros(tokens * spec.top_k, np.int32))}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"E{s.num_experts}k{s.top_k}g{s.num_groups}{s.scoring}")
@pytest.mark.parametrize("biased", [False, True])
def test_router_kernel_matches_numpy(spec, biased):
    if biased and spec.scoring != "sigmoid":
        pytest.skip("the correction bias is DeepSeek-V3's (sigmoid scores)")
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


def test_router_kernel_compiles_with_nvcc_for_sm90a(tmp_path):
    """The device build the GPU runs (NVRTC there; nvcc here, where NVRTC's Python binding is missing)."""
    import os
    import shutil
    import subprocess

    from kernels.raw_cuda import KERNEL_DIR
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not available")
    subprocess.run([nvcc, "-arch=sm_90a", "-c", os.path.join(KERNEL_DIR, "moe_route.cu"), "-o", str(tmp_path / "k.o")],
                   check=True, capture_output=True)
