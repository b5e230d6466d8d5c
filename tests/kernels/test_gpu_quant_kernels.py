"""The quantized-weight kernels on the GPU, on Qwen3-8B's projection shapes (harness/quant_cases.py):

* W4A16 (raw_cuda/gemv_w4.cu) in each 4-bit format at M = 1, 8, 16: exact to the bf16-rounded dequantized
  weights up to float32 accumulation (y equal to x · bf16(W)ᵀ rounded to bf16 but for single-ulp ties;
  e2m1's 0.5, a bf16 subnormal before its 2^126 factor, included); its epilogues and grouped experts; the
  bf16 weights for prefill (w4_dequant.cu) bit for bit.
* FP8: the activation quantization (raw_cuda/fp8_quant.cu) bit for bit against numpy (vLLM's rule), fused after
  the RMSNorm bit for bit as rms_norm.cu then itself; the W8A8 GEMV (gemv_fp8.cu) and the CuTe FP8 GEMM
  (prefill) within a bound set from the measured floor: the relative error against x · dequant(W)ᵀ at most
  FLOOR_FACTOR x the exact W8A8 product's own (the activation quantization's cost, fp8_ref.error_floor) plus
  bf16 output rounding, and against the exact W8A8 product within 2^-8 (FP8 tensor-core accumulation over a
  128-block, promoted in float32, then bf16).

    pytest -q -m gpu tests/kernels/test_gpu_quant_kernels.py        (the CuTe case needs the built library)
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from harness.quant_cases import QWEN3_8B_SHAPES, W4_KINDS, grouped_layout, random_fp8_weight, random_w4
from openinfer_kernels.quant import fp8_ref
from openinfer_kernels.quant import w4_formats as fmt
from openinfer_kernels.quant.ops import QuantOps, W4Weight
from openinfer_kernels.quant.w4_layout import pack_w4

pytestmark = pytest.mark.gpu
FLOOR_FACTOR = 1.1
BF16_ROUNDING = 2.0 ** -8


def bf16_bits(x) -> np.ndarray:
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def values(bits) -> np.ndarray:
    import cupy
    import ml_dtypes
    return cupy.asnumpy(bits).view(ml_dtypes.bfloat16).astype(np.float32)


def assert_bf16_equal_but_ties(got: np.ndarray, want_f32: np.ndarray, what: str, rounded_term=None) -> None:
    """got (bf16 values) is want rounded to bf16, up to one ulp where float32 sums of another order round apart;
    an output that cancels to near zero may differ by the float32 summation error of its terms, whose size
    follows the largest outputs (2^-16 of them: 1.8e-4 seen on a 512-scale qkv product), not its own. A term
    the kernel rounds to bf16 before adding (the residual epilogue's product) may round one ulp apart, an error
    of that ulp however far the sum cancels."""
    want = values(bf16_bits(want_f32))
    allowed = 2 ** -16 * float(np.abs(want).max()) + 2 ** -7 * np.abs(want)
    if rounded_term is not None:
        allowed = allowed + 2 ** -7 * np.abs(rounded_term)
    excess = np.abs(got - want) - allowed
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (what, worst, float(got[worst]), float(want[worst]), float(allowed[worst]))
    assert np.mean(got == want) > 0.95, what


def ops():
    import cupy
    return QuantOps(cupy.cuda.get_current_stream())


@functools.lru_cache(maxsize=4)
def w4_case(name: str, kind: str) -> tuple[W4Weight, np.ndarray]:
    """A projection's random 4-bit weight on the device and its bf16 weights (float32), made once per M."""
    N, K = QWEN3_8B_SHAPES[name]
    w = random_w4(np.random.default_rng(N + len(kind)), kind, N, K, 32 if kind in ("fp4", "bf16") else 128)
    return W4Weight.upload(pack_w4(w)), values(bf16_bits(fmt.dequant(w)))


@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("kind", W4_KINDS)
@pytest.mark.parametrize("name", list(QWEN3_8B_SHAPES))
def test_gemv_w4(name, kind, M):
    import cupy

    weight, weights = w4_case(name, kind)
    x = bf16_bits(np.random.default_rng(M).standard_normal((M, weight.k)))
    y = cupy.full((M, weight.n), 0x7FC0, np.uint16)
    ops().gemv_w4(cupy.asarray(x), weight, y)
    assert_bf16_equal_but_ties(values(y), values(x) @ weights.T, f"{name} {kind} M={M}")


@pytest.mark.parametrize("kind", W4_KINDS)
def test_gemv_w4_reads_each_weight_exactly(kind):
    """One-hot rows of x pick single weights: the float32 product is each bf16 weight bit for bit; FP4 scales
    on both sides of gemv_w4.cu's one-multiply bound (2^(128 - 127)), e2m1's 0.5 a bf16 subnormal before it."""
    import cupy

    rng = np.random.default_rng(len(kind))
    N, K, group, M = 4096, 4096, 32, 16
    w = random_w4(rng, kind, N, K, group)
    if kind == "fp4":
        e = rng.choice(np.array([2, 3, 100, 126, 127, 128, 129, 130], np.uint8), (N, K // group))
        w = fmt.W4Codes(w.codes, fmt.ue8m0_to_bf16_bits(e), fmt.BF16, None, group, fp4=True)
    cols = rng.choice(K, M, replace=False)
    x = np.zeros((M, K), np.uint16)
    x[np.arange(M), cols] = 0x3F80                              # bf16 1.0
    y = cupy.zeros((M, N), np.float32)
    ops().gemv_w4(cupy.asarray(x), W4Weight.upload(pack_w4(w)), y, "f32")
    np.testing.assert_array_equal(cupy.asnumpy(y), values(bf16_bits(fmt.dequant(w)))[:, cols].T)


@pytest.mark.parametrize("kind", W4_KINDS)
def test_dequant_w4_for_prefill(kind):
    """w4_dequant.cu: bit for bit the bf16 of the exact dequantization (gate_up's 24576 x 4096)."""
    import cupy

    N, K = QWEN3_8B_SHAPES["gate_up"]
    w = random_w4(np.random.default_rng(3), kind, N, K, 32 if kind in ("fp4", "bf16") else 128)
    out = cupy.zeros((N, K), np.uint16)
    ops().dequant_w4(W4Weight.upload(pack_w4(w)), out)
    np.testing.assert_array_equal(cupy.asnumpy(out), bf16_bits(fmt.dequant(w)))


@pytest.mark.parametrize("epi", ["residual", "silu", "f32"])
def test_gemv_w4_epilogues(epi):
    import cupy

    N, K, M = 4096, 4096, 5
    rng = np.random.default_rng(len(epi))
    w = random_w4(rng, "fp16_zero", N, K, 128)
    x = bf16_bits(rng.standard_normal((M, K)))
    product = values(x) @ values(bf16_bits(fmt.dequant(w))).T
    weight = W4Weight.upload(pack_w4(w))
    if epi == "f32":
        y = cupy.zeros((M, N), np.float32)
        ops().gemv_w4(cupy.asarray(x), weight, y, "f32")
        np.testing.assert_allclose(cupy.asnumpy(y), product, rtol=1e-4, atol=1e-4)
    elif epi == "residual":
        res = bf16_bits(rng.standard_normal((M, N)))
        y = cupy.asarray(res)
        ops().gemv_w4(cupy.asarray(x), weight, y, "residual", res=y)
        rounded = values(bf16_bits(product))
        assert_bf16_equal_but_ties(values(y), rounded + values(res), epi, rounded_term=rounded)
    else:
        y = cupy.zeros((M, N // 2), np.uint16)
        ops().gemv_w4(cupy.asarray(x), weight, y, "silu")
        c = np.arange(N // 2)
        gate = values(bf16_bits(product[:, (c // 8) * 16 + c % 8]))
        up = values(bf16_bits(product[:, (c // 8) * 16 + c % 8 + 8]))
        assert_bf16_equal_but_ties(values(y), values(bf16_bits(gate / (1 + np.exp(-gate)))) * up, epi)


@pytest.mark.parametrize("kind", ["bf16", "fp4"])
def test_gemv_w4_grouped_experts(kind):
    """Kimi-K2-like experts (2048 x 7168 gate_up halves, group 32), a decode step's rows in tiles of 16."""
    import cupy

    E, N, K, tile_m = 4, 2048, 7168, 16
    rng = np.random.default_rng(9)
    w = random_w4(rng, kind, N, K, 32, (E,))
    counts, experts = [1, 3, 0, 16], [2, 0, 1, 3]
    row_token = np.full(tile_m * E, -1, np.int32)
    for t, c in enumerate(counts):
        row_token[t * tile_m:t * tile_m + c] = np.arange(c)
    a = bf16_bits(rng.standard_normal((tile_m * E, K)))
    out = cupy.full((tile_m * E, N), 0x7FC0, np.uint16)
    ops().gemv_w4_grouped(cupy.asarray(a), W4Weight.upload(pack_w4(w)), cupy.asarray(np.array(experts, np.int32)),
                          cupy.asarray(row_token), out, tile_m)
    got, weights = values(out), values(bf16_bits(fmt.dequant(w)))
    for t, (c, e) in enumerate(zip(counts, experts)):
        rows = slice(t * tile_m, t * tile_m + c)
        if c:
            assert_bf16_equal_but_ties(got[rows], values(a[rows]) @ weights[e].T, f"tile {t}")
        assert np.all(np.isnan(got[t * tile_m + c:(t + 1) * tile_m]))


@pytest.mark.parametrize("kind", ["bf16", "fp4"])
def test_w4_grouped_gemm_at_prefill_sizes(kind):
    """w4_grouped_gemm.cu (the 4-bit experts' prefill product) at DeepSeek-V4-Flash's gate_up (4096 x 4096, group
    32): experts of 300, 0, 64 and 1 rows in tiles of 128 (a partial 64-row block, an all-padding one), the padding
    rows unwritten."""
    import cupy

    E, N, K, tile_m = 4, 4096, 4096, 128
    rng = np.random.default_rng(11)
    w = random_w4(rng, kind, N, K, 32, (E,))
    tile_expert, row_token = grouped_layout([300, 0, 64, 1], tile_m)
    a = bf16_bits(rng.standard_normal((row_token.size, K)))
    out = cupy.full((row_token.size, N), 0x7FC0, np.uint16)
    ops().w4_grouped_gemm(cupy.asarray(a), W4Weight.upload(pack_w4(w)), cupy.asarray(tile_expert),
                          cupy.asarray(row_token), out, tile_m)
    got, weights = values(out), values(bf16_bits(fmt.dequant(w)))
    for t, e in enumerate(tile_expert):
        rows = np.arange(t * tile_m, (t + 1) * tile_m)
        rows = rows[row_token[rows] >= 0]
        assert_bf16_equal_but_ties(got[rows], values(a[rows]) @ weights[e].T, f"tile {t}")
    assert np.all(np.isnan(got[row_token < 0]))


@pytest.mark.parametrize("K", [4096, 12288])
def test_fp8_quant_is_the_reference_and_fuses_after_the_norm(K):
    import cupy

    M = 16
    rng = np.random.default_rng(K)
    x = bf16_bits(rng.standard_normal((M, K)) * 2.0 ** rng.integers(-8, 8, (M, 1)))
    q, s = cupy.zeros((M, K), np.uint8), cupy.zeros((K // 128, M), np.float32)
    ops().fp8_quant(cupy.asarray(x), q, s)
    want_q, want_s = fp8_ref.quantize_activations(values(x))
    np.testing.assert_array_equal(cupy.asnumpy(q), want_q.view(np.uint8))
    np.testing.assert_array_equal(cupy.asnumpy(s), want_s)
    from openinfer_kernels.raw_cuda import kernel

    res, w = bf16_bits(rng.standard_normal((M, K))), bf16_bits(1 + 0.1 * rng.standard_normal(K))
    normed, resid = cupy.zeros((M, K), np.uint16), cupy.zeros((M, K), np.uint16)
    kernel("rms_norm", "rms_norm_residual")((M,), (1024,), (cupy.asarray(x), cupy.asarray(res), cupy.asarray(w), normed,
                                                          resid, np.int32(K), np.float32(1e-6)))
    ops().fp8_quant(normed, q, s)
    q2, s2, resid2 = cupy.zeros_like(q), cupy.zeros_like(s), cupy.zeros_like(resid)
    ops().fp8_quant(cupy.asarray(x), q2, s2, norm_w=cupy.asarray(w), residual=cupy.asarray(res), resid_out=resid2,
                    eps=1e-6)
    for a, b in ((q, q2), (s, s2), (resid, resid2)):
        assert bool(cupy.array_equal(a, b))


def check_w8a8(got_bits, x_bits, q, s, w, ws, channel: bool, what: str) -> None:
    """The gate: within FLOOR_FACTOR x the floor (+ bf16 rounding) of x · dequant(W)ᵀ, and within bf16
    rounding of the exact W8A8 product of the same operands."""
    got, x = values(got_bits), values(x_bits)
    reference = x.astype(np.float64) @ fp8_ref.dequant_weight(w, ws, channel).T
    floor = fp8_ref.error_floor(x, w, ws, channel)
    err = fp8_ref.relative_error(got, reference)
    assert err <= FLOOR_FACTOR * floor + BF16_ROUNDING, f"{what}: {err:.2e} against a floor of {floor:.2e}"
    assert fp8_ref.relative_error(got, fp8_ref.w8a8_exact(q, s, w, ws, channel)) <= BF16_ROUNDING, what


@functools.lru_cache(maxsize=2)
def fp8_case(name: str, channel: bool) -> tuple[np.ndarray, np.ndarray]:
    N, K = QWEN3_8B_SHAPES[name]
    return random_fp8_weight(np.random.default_rng(N + channel), N, K, channel)


@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("channel", [False, True])
@pytest.mark.parametrize("name", list(QWEN3_8B_SHAPES))
def test_gemv_fp8(name, channel, M):
    import cupy

    w, ws = fp8_case(name, channel)
    N, K = w.shape
    x = bf16_bits(np.random.default_rng(M).standard_normal((M, K)))
    q, s = fp8_ref.quantize_activations(values(x))
    y = cupy.full((M, N), 0x7FC0, np.uint16)
    ops().gemv_fp8(cupy.asarray(q.view(np.uint8)), cupy.asarray(s), cupy.asarray(w.view(np.uint8)), cupy.asarray(ws), y)
    check_w8a8(y, x, q, s, w, ws, channel, f"{name} channel={channel} M={M}")


@pytest.mark.parametrize("M", [64, 512, 2048])
@pytest.mark.parametrize("name", list(QWEN3_8B_SHAPES))
def test_cute_fp8_gemm(name, M):
    """Prefill: fp8_quant.cu's activations into the CuTe block-scaled GEMM (the planned variant)."""
    import cupy

    from openinfer_kernels import cute

    if not cute.available():
        pytest.skip(cute.available().reason)
    from openinfer_kernels.cute.gemm import GemmRunner, fp8_gemm

    w, ws = fp8_case(name, False)
    N, K = w.shape
    x = bf16_bits(np.random.default_rng(M).standard_normal((M, K)))
    q, s = cupy.zeros((M, K), np.uint8), cupy.zeros((K // 128, M), np.float32)
    ops().fp8_quant(cupy.asarray(x), q, s)
    y = cupy.full((M, N), 0x7FC0, np.uint16)
    fp8_gemm(GemmRunner(), q, s, cupy.asarray(w.view(np.uint8)), cupy.asarray(ws), y)
    cupy.cuda.get_current_stream().synchronize()
    check_w8a8(y, x, cupy.asnumpy(q).view(fp8_ref.E4M3), cupy.asnumpy(s), w, ws, False, f"{name} M={M}")


def test_gemv_fp8_grouped_experts():
    """DeepSeek-V3-like experts (2048 x 7168), block scales, rows in tiles of 16."""
    import cupy

    E, N, K, tile_m = 3, 2048, 7168, 16
    rng = np.random.default_rng(5)
    weights = [random_fp8_weight(rng, N, K, False) for _ in range(E)]
    counts, experts = [2, 16, 5], [1, 2, 0]
    row_token = np.full(tile_m * E, -1, np.int32)
    for t, c in enumerate(counts):
        row_token[t * tile_m:t * tile_m + c] = np.arange(c)
    x = bf16_bits(rng.standard_normal((tile_m * E, K)))
    q, s = fp8_ref.quantize_activations(values(x))
    out = cupy.full((tile_m * E, N), 0x7FC0, np.uint16)
    ops().gemv_fp8_grouped(cupy.asarray(q.view(np.uint8)), cupy.asarray(s),
                           cupy.asarray(np.stack([a.view(np.uint8) for a, _ in weights])),
                           cupy.asarray(np.stack([b for _, b in weights])), cupy.asarray(np.array(experts, np.int32)),
                           cupy.asarray(row_token), out, tile_m)
    got = cupy.asnumpy(out)
    for t, (c, e) in enumerate(zip(counts, experts)):
        rows = slice(t * tile_m, t * tile_m + c)
        check_w8a8(got[rows], x[rows], q[rows], s[:, rows], weights[e][0], weights[e][1], False, f"tile {t}")


@pytest.mark.parametrize("channel", [False, True])
def test_fp8_grouped_gemm_at_prefill_sizes(channel):
    """fp8_grouped_gemm.cu (the FP8 experts' prefill product) at DeepSeek-V3's gate_up (4096 x 7168): experts of
    300, 0, 64 and 1 rows in tiles of 128, the padding rows unwritten."""
    import cupy

    E, N, K, tile_m = 4, 4096, 7168, 128
    rng = np.random.default_rng(12 + channel)
    weights = [random_fp8_weight(rng, N, K, channel) for _ in range(E)]
    tile_expert, row_token = grouped_layout([300, 0, 64, 1], tile_m)
    x = bf16_bits(rng.standard_normal((row_token.size, K)))
    q, s = fp8_ref.quantize_activations(values(x))
    out = cupy.full((row_token.size, N), 0x7FC0, np.uint16)
    ops().fp8_grouped_gemm(cupy.asarray(q.view(np.uint8)), cupy.asarray(s),
                           cupy.asarray(np.stack([a.view(np.uint8) for a, _ in weights])),
                           cupy.asarray(np.stack([b for _, b in weights])), cupy.asarray(tile_expert),
                           cupy.asarray(row_token), out, tile_m)
    got = cupy.asnumpy(out)
    for t, e in enumerate(tile_expert):
        rows = np.arange(t * tile_m, (t + 1) * tile_m)
        rows = rows[row_token[rows] >= 0]
        check_w8a8(got[rows], x[rows], q[rows], s[:, rows], weights[e][0], weights[e][1], channel, f"tile {t}")
    assert np.all(got[row_token < 0] == 0x7FC0)
