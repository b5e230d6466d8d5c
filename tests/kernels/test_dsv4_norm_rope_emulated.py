"""dsv4_norm_rope.cu (DeepSeek-V4's per-head RMSNorm and partial rope in one launch) through GpuDSV4Ops.norm_rope on
the host, without a GPU (tests/cuda_emulation.h), against the numpy definition (cpu_dsv4_attention.norm_rope: rms
then rope_trailing at cos_sin's angles): V4-Flash's q (64 heads of 512, 64 rope dims), its K = V row (one head, the
norm's weight), its indexer queries (64 of 128, rope only), the inverse rope on the output and the q LoRA's norm
(1024 values, no rope), at positions up to a million; float32 rounding apart (the sum of squares in another order, sincosf): max |Δ| <= 2e-5 of values ~1. The
check fails with the rope's direction or the norm's weight left out. Skipped without g++ or the CUDA headers; the
GPU gate runs the kernel inside the line (tests/gpu/test_gpu_dsv4.py)."""
from __future__ import annotations

import numpy as np
import pytest
from test_deltanet_kernels_emulated import host
from test_dsv4_hc_emulated import EmulatedDSV4

from engine.executor.cpu_dsv4_attention import norm_rope

# (tokens, heads, d, rope pairs, norm, weight, inverse): q, K = V, the indexer's queries, the output
CASES = [(3, 64, 512, 32, True, False, False), (5, 1, 512, 32, True, True, False),
         (2, 64, 128, 32, False, False, False), (3, 64, 512, 32, False, False, True),
         (4, 2, 40, 4, True, True, False), (3, 1, 1024, 0, True, True, False)]      # ..., the q LoRA (no rope)
TOL = 2e-5


def inputs(T: int, heads: int, d: int, half: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (T, heads, d)).astype(np.float32)
    positions = np.array([0, 1_000_003, 77, 4096, 65535][:T], np.int32)
    inv_freq = (10000.0 ** (-np.arange(half) / half)).astype(np.float32)
    weight = rng.normal(1, 0.2, d).astype(np.float32)
    return x, positions, inv_freq, weight


def kernel_run(case, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the kernel's output, the numpy definition's) of one case."""
    T, heads, d, half, norm, weighted, inverse = case
    x, positions, inv_freq, weight = inputs(T, heads, d, half, seed)
    eps, w = (1e-6 if norm else None), (weight if weighted else None)
    want = norm_rope(x.copy(), positions, inv_freq, eps, w, inverse)
    got = EmulatedDSV4().norm_rope(host(x.copy()), host(positions), inv_freq, eps, None if w is None else host(w),
                                   inverse)
    return np.asarray(got), want


@pytest.mark.parametrize("case", CASES, ids=str)
def test_norm_rope_matches_numpy(case):
    got, want = kernel_run(case)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("flip", ["inverse", "weight"])
def test_the_check_fails_with_the_rope_reversed_or_the_weight_dropped(flip):
    case = CASES[1]
    got, want = kernel_run(case)
    T, heads, d, half, norm, weighted, inverse = case
    x, positions, inv_freq, weight = inputs(T, heads, d, half, 0)
    wrong = norm_rope(x, positions, inv_freq, 1e-6, None if flip == "weight" else weight, flip == "inverse")
    assert np.abs(got - wrong).max() > 100 * TOL
