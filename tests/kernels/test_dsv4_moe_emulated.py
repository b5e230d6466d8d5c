"""DeepSeek-V4's MoE kernels on the host, without a GPU (tests/cuda_emulation.h), against the numpy definitions:
silu_mul.cu's silu_mul_limited (the limited SwiGLU, the routed experts' activation and the shared expert's, through
GpuMoEOps.expert_activation and GpuDSV4Ops.swiglu_limited; cpu_dsv4_ops.swiglu_limited in float32, then one bf16
rounding), both gate_up layouts, values past the limit on either side, equal but for a bf16 ulp where expf's last
bit turns the rounding; moe_route.cu's moe_hash_route (GpuDSV4Ops.hash_route; cpu_dsv4_ops.hash_route) to float32
rounding. The checks fail with the limit ignored, and with the table read at the wrong token. Skipped without g++
or the CUDA headers."""
from __future__ import annotations

import numpy as np
import pytest
from dsv4_indexer_cases import bf16, f32
from test_deltanet_kernels_emulated import host
from test_dsv4_gpu_emulated import EmulatedMoE
from test_dsv4_hc_emulated import EmulatedDSV4, EmulatedHCShared

from types import SimpleNamespace

from test_dsv4_out_emulated import EmulatedGemm

from engine.executor.cpu_dsv4_ops import hash_route, swiglu_limited

LIMIT = 7.0


def gate_up_case(rows: int, inter: int, interleaved: bool, seed: int = 0):
    """(bf16 gate_up as the device holds it, its [gate | up] float32 values)."""
    rng = np.random.default_rng(seed)
    plain = bf16(rng.normal(0, 6, (rows, 2 * inter)))             # a third of the values past the limit
    if not interleaved:
        return plain, f32(plain)
    g, u = plain[:, :inter].reshape(rows, -1, 8), plain[:, inter:].reshape(rows, -1, 8)
    return np.stack([g, u], axis=2).reshape(rows, 2 * inter), f32(plain)


def run(rows: int, inter: int, interleaved: bool, limit=LIMIT, shared_expert: bool = False) -> np.ndarray:
    shared = EmulatedHCShared()
    shared.gate_up_interleaved = interleaved
    moe = EmulatedMoE(shared, rows, 4, 2, None)
    device, _ = gate_up_case(rows, inter, interleaved)
    if shared_expert:
        return f32(np.asarray(EmulatedDSV4(shared, moe).swiglu_limited(host(device), limit)))
    out = host(np.zeros((rows, inter), np.uint16))
    moe.expert_activation(host(device), out, limit)
    return f32(np.asarray(out))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shared_expert", [False, True])
def test_limited_swiglu_matches_numpy(interleaved, shared_expert):
    rows, inter = 5, 48
    _, values = gate_up_case(rows, inter, interleaved)
    want = f32(bf16(swiglu_limited(values, LIMIT)))
    got = run(rows, inter, interleaved, shared_expert=shared_expert)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert (got == want).mean() > 0.99


def test_the_check_fails_with_the_limit_ignored():
    _, values = gate_up_case(5, 48, True)
    got = run(5, 48, True)
    assert np.abs(got - f32(bf16(swiglu_limited(values, 1e9)))).max() > 1.0


def hash_case(T: int = 7, E: int = 40, k: int = 6, vocab: int = 50, seed: int = 1):
    rng = np.random.default_rng(seed)
    x, gate = bf16(rng.normal(0, 1, (T, 64))), bf16(rng.normal(0, 0.5, (E, 64)))
    table = np.stack([rng.permutation(E)[:k] for _ in range(vocab)])        # distinct experts a token
    return x, gate, table, rng.integers(0, vocab, T).astype(np.int32)


def hash_run(x, gate, table, tokens, scale: float = 1.5):
    shared = EmulatedHCShared()
    shared.gemm = EmulatedGemm()
    moe = EmulatedMoE(shared, x.shape[0], gate.shape[0], table.shape[1], None)
    w, ids = EmulatedDSV4(shared, moe).hash_route(host(x), host(gate), host(bf16(table)), SimpleNamespace(scale=scale),
                                                  SimpleNamespace(input_ids=host(tokens)))
    return np.asarray(w), np.asarray(ids)


def test_hash_route_matches_numpy():
    x, gate, table, tokens = hash_case()
    got_w, got_ids = hash_run(x, gate, table, tokens)
    want_w, want_ids = hash_route(f32(x) @ f32(gate).T, table, tokens, 1.5)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=0)
    wrong_w, _ = hash_route(f32(x) @ f32(gate).T, table, np.roll(tokens, 1), 1.5)
    assert np.abs(got_w - wrong_w).max() > 1e-2
