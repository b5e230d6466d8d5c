"""W8A8 FP8: the activation quantization (raw_cuda/fp8_quant.cu) bit for bit against vLLM's per-token-group rule
(written here in torch: scale = max(amax, 1e-10) / 448, e4m3 of x / scale clamped to ±448) and against
rms_norm.cu + itself when fused after the RMSNorm; the decode GEMV (raw_cuda/gemv_fp8.cu) against the exact
W8A8 product (openinfer_kernels/quant/fp8_ref.py, float64) up to bf16 output rounding, with block and
channel weight scales, its epilogues and its grouped (MoE) entry. All on the host emulation of the kernels,
through their launches (quant/ops.py). The GPU gate against the measured floor is test_gpu_quant_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest

from harness.quant_cases import random_fp8_weight
from openinfer_kernels.quant import fp8_ref
from openinfer_kernels.quant.ops import GemvConfig
from test_decode_kernels_emulated import assert_bf16_close, run
from test_deltanet_kernels_emulated import host
from test_quant_w4 import EmulatedQuantOps
from test_rope_cache_emulated import bf16, f32, rb


def vllm_per_token_group_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per_token_group_quant_fp8 arithmetic in torch: (e4m3 bytes [M, K], scales [M, K/128])."""
    import torch

    t = torch.from_numpy(np.asarray(x, np.float32)).reshape(x.shape[0], -1, 128)
    scale = t.abs().amax(-1).clamp(min=1e-10) / 448.0
    q = (t / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(x.shape).view(torch.uint8).numpy(), scale.numpy()


def activations(rng, M, K) -> np.ndarray:
    """bf16 rows with spread magnitudes, an all-zero group and a tiny one (the eps clamp)."""
    x = rng.standard_normal((M, K)) * 2.0 ** rng.integers(-6, 6, (M, 1))
    x[0, :128] = 0
    if K > 128:
        x[-1, 128:256] *= 1e-30
    return bf16(x)


def test_reference_is_vllms_rule():
    rng = np.random.default_rng(0)
    x = f32(activations(rng, 6, 512))
    q, s = fp8_ref.quantize_activations(x)
    want_q, want_s = vllm_per_token_group_quant(x)
    np.testing.assert_array_equal(q.view(np.uint8), want_q)
    np.testing.assert_array_equal(s, want_s.T)


@pytest.mark.parametrize("M,K,threads", [(3, 384, 64), (5, 1024, 128), (2, 128, 32)])
def test_fp8_quant_kernel(M, K, threads):
    """Every byte and scale as the reference, the scales MN-major at a padded ld (K / 8 vectors over fewer
    threads: several passes; one group split over two warps never happens: 16 threads a group)."""
    rng = np.random.default_rng(M + K)
    x = activations(rng, M, K)
    ld = M + 3
    q, s = host(np.zeros((M, K), np.uint8)), host(np.full((K // 128, ld), -1, np.float32))
    ops = EmulatedQuantOps()
    ops.fp8_quant(host(x), q, s)
    want_q, want_s = fp8_ref.quantize_activations(f32(x), ld)
    np.testing.assert_array_equal(q, want_q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s)[:, :M], want_s[:, :M])
    assert np.all(np.asarray(s)[:, M:] == -1)


@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_fp8_quant_is_rms_norm_then_quant(with_residual):
    """rms_norm_residual_fp8_quant: bit for bit rms_norm.cu's rms_norm_residual followed by fp8_quant."""
    rng = np.random.default_rng(with_residual)
    M, K = 4, 640
    x, res, w = bf16(rng.standard_normal((M, K))), bf16(rng.standard_normal((M, K))), bf16(1 + 0.2 * rng.standard_normal(K))
    normed, resid_a = host(np.zeros((M, K), np.uint16)), host(np.zeros((M, K), np.uint16))
    run("rms_norm", "rms_norm_residual", (M,), 128,
        (host(x), host(res) if with_residual else np.uint64(0), host(w), normed, resid_a, np.int32(K), np.float32(1e-6)))
    ops = EmulatedQuantOps()
    q_a, s_a = host(np.zeros((M, K), np.uint8)), host(np.zeros((K // 128, M), np.float32))
    ops.fp8_quant(normed, q_a, s_a)
    q_b, s_b = host(np.zeros((M, K), np.uint8)), host(np.zeros((K // 128, M), np.float32))
    resid_b = host(np.zeros((M, K), np.uint16)) if with_residual else None
    ops.fp8_quant(host(x), q_b, s_b, norm_w=host(w), residual=host(res) if with_residual else None,
                  resid_out=resid_b, eps=1e-6)
    np.testing.assert_array_equal(q_a, q_b)
    np.testing.assert_array_equal(s_a, s_b)
    if with_residual:
        np.testing.assert_array_equal(resid_a, resid_b)


@pytest.mark.parametrize("channel", [False, True])
@pytest.mark.parametrize("M", [1, 6, 13])
def test_gemv_fp8_is_the_w8a8_product(channel, M):
    """y = bf16(sum_kb sw · sx · (xq · wq)): 200 rows (two 128-row scale blocks, a partial tile), K 640 in
    5 blocks over 4 k-warps; within the floor set by the activation quantization against x · dequant(W)ᵀ."""
    rng = np.random.default_rng(M + 10 * channel)
    N, K = 200, 640
    w, ws = random_fp8_weight(rng, N, K, channel)
    x = activations(rng, M, K)
    q, s = fp8_ref.quantize_activations(f32(x), M + 1)
    y = host(np.zeros((M, N), np.uint16))
    EmulatedQuantOps().gemv_fp8(host(q.view(np.uint8)), host(s), host(w.view(np.uint8)), host(ws), y)
    exact = fp8_ref.w8a8_exact(q, s, w, ws, channel)
    assert_bf16_close(y, rb(exact), f"channel={channel}")
    floor = fp8_ref.error_floor(f32(x), w, ws, channel)
    reference = f32(x).astype(np.float64) @ fp8_ref.dequant_weight(w, ws, channel).T
    assert fp8_ref.relative_error(f32(np.asarray(y)), reference) <= floor + 2.0 ** -8


@pytest.mark.parametrize("tiles,steps", [(1, 1), (1, 3), (4, 2), (8, 1)])
def test_gemv_fp8_cta_shapes(tiles, steps):
    """The CTA shapes bench/quant_kernels.py --fp8-configs times (tiles a CTA x 128-blocks in flight): the same
    products for 9 rows, N past whole CTAs, K's 7 blocks split unevenly over the tile's warps."""
    rng = np.random.default_rng(tiles * 8 + steps)
    M, N, K = 9, 176, 896
    w, ws = random_fp8_weight(rng, N, K, False)
    q, s = fp8_ref.quantize_activations(f32(activations(rng, M, K)))
    y = host(np.zeros((M, N), np.uint16))
    EmulatedQuantOps(fp8=GemvConfig(tiles, steps)).gemv_fp8(host(q.view(np.uint8)), host(s), host(w.view(np.uint8)),
                                                            host(ws), y)
    assert_bf16_close(y, rb(fp8_ref.w8a8_exact(q, s, w, ws)), f"{tiles}x{steps}")


@pytest.mark.parametrize("epi", ["f32", "residual", "silu"])
def test_gemv_fp8_epilogues(epi):
    rng = np.random.default_rng(len(epi))
    M, N, K = 3, 64, 256
    w, ws = random_fp8_weight(rng, N, K, False)
    q, s = fp8_ref.quantize_activations(f32(activations(rng, M, K)))
    product = fp8_ref.w8a8_exact(q, s, w, ws)
    args = (host(q.view(np.uint8)), host(s), host(w.view(np.uint8)), host(ws))
    if epi == "f32":
        y = host(np.zeros((M, N), np.float32))
        EmulatedQuantOps().gemv_fp8(*args, y, "f32")
        np.testing.assert_allclose(y, product, rtol=1e-5, atol=1e-6)
    elif epi == "residual":
        res = bf16(rng.standard_normal((M, N)))
        y = host(res.copy())
        EmulatedQuantOps().gemv_fp8(*args, y, "residual", res=y)
        assert_bf16_close(y, rb(rb(product) + f32(res)), epi)
    else:
        y = host(np.zeros((M, N // 2), np.uint16))
        EmulatedQuantOps().gemv_fp8(*args, y, "silu")
        c = np.arange(N // 2)
        gate, up = rb(product[:, (c // 8) * 16 + c % 8]), rb(product[:, (c // 8) * 16 + c % 8 + 8])
        assert_bf16_close(y, rb(rb(gate / (1 + np.exp(-gate))) * up), epi)


def test_gemv_fp8_grouped_experts():
    """Expert-grouped rows in tiles of 20 (one of 17 rows: two chunks), each with its tile's expert."""
    rng = np.random.default_rng(4)
    E, N, K, tile_m = 2, 48, 256, 20
    weights = [random_fp8_weight(rng, N, K, False) for _ in range(E)]
    w = np.stack([a.view(np.uint8) for a, _ in weights])
    ws = np.stack([b for _, b in weights])
    counts, experts = [17, 3], [1, 0]
    rows = tile_m * len(counts)
    row_token = np.full(rows, -1, np.int32)
    for t, c in enumerate(counts):
        row_token[t * tile_m:t * tile_m + c] = np.arange(c)
    q, s = fp8_ref.quantize_activations(f32(activations(rng, rows, K)))
    out = host(np.full((rows, N), 0x7FC0, np.uint16))
    EmulatedQuantOps().gemv_fp8_grouped(host(q.view(np.uint8)), host(s), host(w), host(ws),
                                        host(np.array(experts, np.int32)), host(row_token), out, tile_m)
    for t, (c, e) in enumerate(zip(counts, experts)):
        lo = t * tile_m
        want = fp8_ref.w8a8_exact(q[lo:lo + c], s[:, lo:], weights[e][0], weights[e][1])
        assert_bf16_close(np.asarray(out)[lo:lo + c], rb(want), f"tile {t}")
        assert np.all(np.asarray(out)[lo + c:lo + tile_m] == 0x7FC0)


def test_fp8_ops_refuse_bad_shapes():
    ops = EmulatedQuantOps()
    x = host(np.zeros((2, 200), np.uint16))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.fp8_quant(x, host(np.zeros((2, 200), np.uint8)), host(np.zeros((1, 2), np.float32)))
    q, s = host(np.zeros((2, 256), np.uint8)), host(np.zeros((2, 2), np.float32))
    w = host(np.zeros((64, 256), np.uint8))
    with pytest.raises(ValueError, match="weight scales"):
        ops.gemv_fp8(q, s, w, host(np.zeros((1, 1), np.float32)), host(np.zeros((2, 64), np.uint16)))
    with pytest.raises(ValueError, match="1..16 rows"):
        ops.gemv_fp8(host(np.zeros((20, 256), np.uint8)), host(np.zeros((2, 20), np.float32)), w,
                     host(np.zeros((1, 2), np.float32)), host(np.zeros((20, 64), np.uint16)))
