"""W4A16: the formats' readers (openinfer_kernels/quant/w4_formats.py) exact against each format's own
dequantization, the kernel layout (w4_layout.py) lossless, and raw_cuda/gemv_w4.cu through its host launches
(quant/ops.py) on the host emulation of the tests (cuda_emulation.h), exact to the bf16-rounded dequantized
weights up to float32 accumulation order.

The references are written apart from the readers: AWQ's packing and dequantization as AutoAWQ does them
(pack order [0, 2, 4, 6, 1, 3, 5, 7], (q - z) · s in fp16), GPTQ's as AutoGPTQ packs v1 checkpoints (zeros
minus one) and GPTQModel reads them (+1 on every nibble, then (q - z) · s in fp16), compressed-tensors' and
FP4 as the loader dequantizes them today (engine/loader/quantized.py, with harness/quantized.py's bit-by-bit
packer). Each reader is also shown to fail on another format's order. What the emulation cannot see (speed,
bf16 subnormals on the device) is for tests/kernels/test_gpu_quant_kernels.py."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.loader.quantized import dequant_fp4_block, dequant_packed_group
from harness.quant_cases import W4_KINDS, random_w4
from harness.quantized import AWQ_PACK_ORDER, pack_int32_bitwise, pack_words, quantize_int_group
from openinfer_kernels.quant import w4_formats as fmt
from openinfer_kernels.quant.ops import QuantOps, GemvConfig, W4Weight
from openinfer_kernels.quant.w4_layout import pack_w4, unpack_w4
from test_decode_kernels_emulated import assert_bf16_close, run
from test_deltanet_kernels_emulated import host
from test_rope_cache_emulated import bf16, f32, rb


class EmulatedQuantOps(QuantOps):
    """QuantOps whose launches run on the host emulation (arguments and grids exactly as on the GPU)."""

    pdl = False

    def _kernel(self, name, entry, **defines):
        return name, entry, defines

    def _launch(self, k, grid, block, args):
        name, entry, defines = k
        run(name, entry, tuple(grid), block[0], args, **defines)


def awq_checkpoint(rng, N, K, group):
    """(qweight [K, N/8], qzeros [K/g, N/8], scales fp16 [K/g, N], q [K, N], z [K/g, N]) packed as AutoAWQ does."""
    q = rng.integers(0, 16, (K, N))
    z = rng.integers(0, 16, (K // group, N))
    scales = (rng.uniform(0.2, 2, (K // group, N)) * 2.0 ** rng.integers(-12, -2, (K // group, N))).astype(np.float16)
    return pack_words(q, AWQ_PACK_ORDER), pack_words(z, AWQ_PACK_ORDER), scales, q, z


def autoawq_dequantize(qweight, qzeros, scales, group):
    """AutoAWQ's dequantize_gemm rule (torch, fp16): unpack by shifts, undo the order, (q - z) · s. [K, N]."""
    import torch

    shifts = torch.arange(0, 32, 4)
    iw = (torch.from_numpy(qweight)[:, :, None] >> shifts).to(torch.int8).reshape(qweight.shape[0], -1)
    iz = (torch.from_numpy(qzeros)[:, :, None] >> shifts).to(torch.int8).reshape(qzeros.shape[0], -1)
    order = torch.arange(iw.shape[1]).reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    iw, iz = iw[:, order] & 15, iz[:, order] & 15
    s = torch.from_numpy(scales).repeat_interleave(group, 0)
    return ((iw - iz.repeat_interleave(group, 0)) * s).numpy()


def gptq_v1_checkpoint(rng, N, K, group, sym):
    """AutoGPTQ's v1 packing: qweight [K/8, N] along K, zeros minus one packed along N."""
    q = rng.integers(0, 16, (K, N))
    z = np.full((K // group, N), 8) if sym else rng.integers(1, 16, (K // group, N))
    scales = (rng.uniform(0.2, 2, (K // group, N)) * 2.0 ** -8).astype(np.float16)
    qweight = pack_words(q.T).T.copy()                        # column n, word r: k = 8r + i in bits 4i
    return qweight, pack_words(z - 1), scales, q, z


def gptqmodel_dequantize(qweight, qzeros, scales, group):
    """GPTQModel's reading of a v1 checkpoint: + 1 on every zero nibble (0x11111111 per word), then
    scales[g] · (q - zeros[g]) in fp16. [K, N]."""
    import torch

    shifts = torch.arange(0, 32, 4)
    zw = torch.from_numpy(qzeros.view(np.uint32).astype(np.int64) + 0x11111111)
    zeros = ((zw[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1)
    w = ((torch.from_numpy(qweight.view(np.uint32).astype(np.int64))[:, None, :] >> shifts[None, :, None]) & 15)
    w = w.reshape(-1, qweight.shape[1])
    g_idx = torch.arange(w.shape[0]) // group
    return (torch.from_numpy(scales)[g_idx] * (w - zeros[g_idx]).to(torch.float16)).numpy()


@pytest.mark.parametrize("N,K,group", [(64, 256, 128), (24, 128, 32), (40, 384, 64)])
def test_awq_reader_is_autoawq(N, K, group):
    rng = np.random.default_rng(N + K)
    qweight, qzeros, scales, q, z = awq_checkpoint(rng, N, K, group)
    w = fmt.from_awq(qweight, qzeros, scales, group)
    assert w.scale_dtype == fmt.FP16 and w.zeros is not None
    np.testing.assert_array_equal(w.codes, q.T)
    np.testing.assert_array_equal(w.zeros, z.T)
    want = autoawq_dequantize(qweight, qzeros, scales, group).T
    np.testing.assert_array_equal(fmt.dequant(w).astype(np.float16), want)       # fp16 of the exact product
    wrong = fmt.from_gptq(pack_words(q.T).T.copy(), qzeros, scales, group, v2=True)   # GPTQ's order on AWQ zeros
    assert not np.array_equal(fmt.dequant(wrong).astype(np.float16), want)


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_reader_is_gptqmodel(sym):
    rng = np.random.default_rng(7 + sym)
    N, K, group = 48, 256, 64
    qweight, qzeros, scales, q, z = gptq_v1_checkpoint(rng, N, K, group, sym)
    w = fmt.from_gptq(qweight, qzeros, scales, group, g_idx=np.arange(K) // group)
    assert (w.zeros is None) == sym                          # symmetric: the kernels' constant zero 8
    np.testing.assert_array_equal(w.codes, q.T)
    want = gptqmodel_dequantize(qweight, qzeros, scales, group).T
    np.testing.assert_array_equal(fmt.dequant(w).astype(np.float16), want)
    v2 = fmt.from_gptq(qweight, pack_words(z), scales, group, v2=True)          # gptq_v2 stores the zeros as they are
    np.testing.assert_array_equal(fmt.dequant(v2), fmt.dequant(w))
    assert not np.array_equal(fmt.dequant(fmt.from_gptq(qweight, qzeros, scales, group, v2=True)), fmt.dequant(w))


def test_gptq_act_order_is_refused():
    rng = np.random.default_rng(3)
    qweight, qzeros, scales, _, _ = gptq_v1_checkpoint(rng, 16, 128, 32, True)
    with pytest.raises(ValueError, match="act-order"):
        fmt.from_gptq(qweight, qzeros, scales, 32, g_idx=rng.permutation(128) // 32)


@pytest.mark.parametrize("N,K,group", [(32, 256, 32), (20, 96, 32), (16, 128, 128)])
def test_compressed_tensors_reader_is_the_loader(N, K, group):
    """bf16 of the exact product is compressed-tensors' bf16 product (the loader's dequantization)."""
    rng = np.random.default_rng(N * K)
    q, scale, _ = quantize_int_group(rng.standard_normal((N, K)).astype(np.float32), 4, group)
    packed = pack_int32_bitwise(q, 4)
    w = fmt.from_compressed_tensors(packed, scale, (N, K), group)
    assert w.zeros is None and w.scale_dtype == fmt.BF16
    want = dequant_packed_group(packed, scale, (N, K), 4, group)
    np.testing.assert_array_equal(rb(fmt.dequant(w)), want)
    np.testing.assert_array_equal(w.codes.astype(np.int16) - 8, q)
    awq_order = fmt.nibbles(packed)[..., list(fmt.AWQ_REVERSE_ORDER)].reshape(N, -1)[:, :K]
    assert not np.array_equal(awq_order, w.codes)


def test_fp4_reader_is_the_loader():
    """Every e2m1 code, ue8m0 scales down to 2^-127 (a bf16 subnormal): exact against the loader."""
    rng = np.random.default_rng(11)
    N, K = 16, 256
    packed = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    packed[0, :8] = np.arange(0, 256, 17)[:8].astype(np.uint8)        # codes 0..15 in both nibbles
    e = rng.integers(100, 135, (N, K // 32)).astype(np.uint8)
    e[1, 0], e[2, 1] = 0, 1
    scale = e.view(ml_dtypes.float8_e8m0fnu)
    w = fmt.from_fp4(packed.view(np.int8), scale)
    assert w.fp4 and w.group == 32
    np.testing.assert_array_equal(fmt.dequant(w), dequant_fp4_block(packed.view(np.int8), scale))
    np.testing.assert_array_equal(rb(fmt.dequant(w)), fmt.dequant(w))   # exact in bf16: the kernel's weights


@pytest.mark.parametrize("kind", W4_KINDS)
@pytest.mark.parametrize("N,K,group,lead", [(40, 160, 32, ()), (16, 512, 128, (3,)), (33, 256, 256, ())])
def test_layout_round_trips(kind, N, K, group, lead):
    rng = np.random.default_rng(N + K + len(kind))
    w = random_w4(rng, kind, N, K, group, lead)
    p = pack_w4(w)
    back = unpack_w4(p)
    for a, b in ((back.codes, w.codes), (back.scales, w.scales), (back.zeros, w.zeros)):
        np.testing.assert_array_equal(a, b)
    assert p.codes.shape[-5:] == (-(-N // 16), -(-K // 128), 2, 32, 4)
    assert p.defines == {"W4_FP4": int(kind == "fp4"), "W4_ZERO": int(kind == "fp16_zero"),
                         "W4_SCALE_FP16": int(kind.startswith("fp16"))}


def test_layout_puts_each_code_where_the_kernel_reads_it():
    """Lane 4g + t of step s, half h, word w, nibble NIBBLE_OF[j]: row 16·tile + g + 8h, k = 128s + 32t + 8w + j."""
    rng = np.random.default_rng(5)
    w = random_w4(rng, "bf16", 32, 256, 32)
    p = pack_w4(w)
    for _ in range(200):
        row, k = rng.integers(0, 32), rng.integers(0, 256)
        tile, g, h = row // 16, row % 8, row % 16 // 8
        s, t, word, j = k // 128, k % 128 // 32, k % 32 // 8, k % 8
        nib = (0, 4, 1, 5, 2, 6, 3, 7)[j]
        assert (int(p.codes[tile, s, h, 4 * g + t, word]) >> (4 * nib)) & 15 == w.codes[row, k]
        assert p.scales[tile, k // 32, g, h] == w.scales[row, k // 32]


def kernel_reference(x_bits, w: fmt.W4Codes) -> np.ndarray:
    """x · bf16(dequant(W))ᵀ in float32 (the kernel's operands, exactly)."""
    return f32(x_bits) @ rb(fmt.dequant(w)).T


@pytest.mark.parametrize("kind", W4_KINDS)
@pytest.mark.parametrize("M", [1, 6, 13])
def test_gemv_w4_matches_the_dequantized_product(kind, M):
    """y = bf16(x · bf16(W)ᵀ): 40 rows (a tile and a half past N), K 384 in 3 steps over 4 k-warps (one idle)."""
    rng = np.random.default_rng(M * 31 + len(kind))
    N, K, group = 40, 384, 64 if kind != "fp4" else 32
    w = random_w4(rng, kind, N, K, group)
    x = bf16(rng.standard_normal((M, K)))
    y = host(np.zeros((M, N), np.uint16))
    EmulatedQuantOps().gemv_w4(host(x), W4Weight.upload(pack_w4(w), host), y)
    assert_bf16_close(y, rb(kernel_reference(x, w)), kind)


@pytest.mark.parametrize("kind", W4_KINDS)
@pytest.mark.parametrize("N,K,group,M", [(24, 2560, 128, 8), (40, 2304, 32, 3), (17, 160, 32, 1), (33, 384, 96, 16),
                                         (16, 384, 384, 9)])
def test_gemv_w4_shapes(kind, N, K, group, M):
    """Every shape the layout takes: K past 8 warps' first two steps (the code ring refills), K short of a
    whole step (lanes past K), N short of a tile, groups of 32, 96 (not a power of two), 128 and K, M 1..16."""
    rng = np.random.default_rng(N * K + M + len(kind))
    if kind == "fp4" and group != 32:
        group = 32                                              # e2m1 checkpoints come in groups of 32
    w = random_w4(rng, kind, N, K, group)
    x = bf16(rng.standard_normal((M, K)))
    y = host(np.zeros((M, N), np.uint16))
    EmulatedQuantOps().gemv_w4(host(x), W4Weight.upload(pack_w4(w), host), y)
    assert_bf16_close(y, rb(kernel_reference(x, w)), f"{kind} {N}x{K} g{group} M={M}")


@pytest.mark.parametrize("tiles,steps", [(2, 3), (4, 1), (8, 4)])
def test_gemv_w4_cta_shapes(tiles, steps):
    """The CTA shapes bench/quant_kernels.py --w4-configs times (tiles a CTA x steps in flight), dense and
    grouped, give the same product; a shape the kernel cannot take is refused."""
    rng = np.random.default_rng(tiles * 8 + steps)
    N, K, M = 72, 1536, 5
    w = random_w4(rng, "bf16", N, K, 32, (2,))
    x = bf16(rng.standard_normal((M, K)))
    ops = EmulatedQuantOps(w4=GemvConfig(tiles, steps))
    y = host(np.zeros((M, N), np.uint16))
    ops.gemv_w4(host(x), W4Weight.upload(pack_w4(fmt.expert_codes(w, 0)), host), y)
    assert_bf16_close(y, rb(kernel_reference(x, fmt.expert_codes(w, 0))), "dense")
    out = host(np.zeros((2 * 8, N), np.uint16))
    row_token = np.where(np.arange(16) % 8 < M, 0, -1).astype(np.int32)
    a = np.zeros((16, K), np.uint16)
    a[:M], a[8:8 + M] = x, x
    ops.gemv_w4_grouped(host(a), W4Weight.upload(pack_w4(w), host), host(np.array([1, 0], np.int32)), host(row_token),
                        out, 8)
    for t, e in enumerate((1, 0)):
        assert_bf16_close(np.asarray(out)[8 * t:8 * t + M], rb(kernel_reference(x, fmt.expert_codes(w, e))), f"expert {e}")
    with pytest.raises(ValueError, match="tiles a CTA"):
        GemvConfig(3, 2)


@pytest.mark.parametrize("kind", W4_KINDS)
def test_gemv_w4_reads_each_weight_exactly(kind):
    """One-hot rows of x pick single weights: the float32 product is each bf16 weight bit for bit. FP4 scales
    span the one-multiply bound (scale · 2^126 a bf16 up to 2^(128 - 127)) and bf16's subnormal 2^-127."""
    rng = np.random.default_rng(len(kind))
    N, K, group, M = 24, 512, 32, 16
    w = random_w4(rng, kind, N, K, group)
    if kind == "fp4":
        e = rng.choice(np.array([0, 1, 2, 100, 126, 127, 128, 129, 130], np.uint8), (N, K // group))
        w = fmt.W4Codes(w.codes, fmt.ue8m0_to_bf16_bits(e), fmt.BF16, None, group, fp4=True)
    cols = rng.choice(K, M, replace=False)
    x = np.zeros((M, K), np.uint16)
    x[np.arange(M), cols] = 0x3F80                              # bf16 1.0
    y = host(np.zeros((M, N), np.float32))
    EmulatedQuantOps().gemv_w4(host(x), W4Weight.upload(pack_w4(w), host), y, "f32")
    np.testing.assert_array_equal(np.asarray(y), rb(fmt.dequant(w))[:, cols].T)


@pytest.mark.parametrize("epi", ["f32", "residual", "silu"])
def test_gemv_w4_epilogues(epi):
    """float32 out; bf16(bf16(x · Wᵀ) + res) in place; SiLU(bf16 gate) · bf16 up of interleaved gate / up rows."""
    rng = np.random.default_rng(len(epi))
    M, N, K = 5, 64, 256
    w = random_w4(rng, "fp16_zero", N, K, 128)
    x = bf16(rng.standard_normal((M, K)))
    product = kernel_reference(x, w)
    weight = W4Weight.upload(pack_w4(w), host)
    if epi == "f32":
        y = host(np.zeros((M, N), np.float32))
        EmulatedQuantOps().gemv_w4(host(x), weight, y, "f32")
        np.testing.assert_allclose(y, product, rtol=1e-5, atol=1e-5)
    elif epi == "residual":
        res = bf16(rng.standard_normal((M, N)))
        y = host(res.copy())
        EmulatedQuantOps().gemv_w4(host(x), weight, y, "residual", res=y)
        assert_bf16_close(y, rb(rb(product) + f32(res)), epi)
    else:
        y = host(np.zeros((M, N // 2), np.uint16))
        EmulatedQuantOps().gemv_w4(host(x), weight, y, "silu")
        c = np.arange(N // 2)
        gate, up = rb(product[:, (c // 8) * 16 + c % 8]), rb(product[:, (c // 8) * 16 + c % 8 + 8])
        assert_bf16_close(y, rb(rb(gate / (1 + np.exp(-gate))) * up), epi)


def test_gemv_w4_grouped_experts():
    """moe_align's expert-grouped rows (tiles of 8, padded with row_token -1; one tile of 18 rows in two
    chunks): each real row times its tile's expert, padding rows and tiles untouched."""
    rng = np.random.default_rng(2)
    E, N, K, tile_m = 3, 48, 256, 24
    w = random_w4(rng, "fp16_zero", N, K, 64, (E,))
    counts, experts = [2, 0, 18], [0, 1, 2]
    rows = tile_m * len(counts)
    row_token = np.full(rows, -1, np.int32)
    for t, c in enumerate(counts):
        row_token[t * tile_m:t * tile_m + c] = np.arange(c)
    a = bf16(rng.standard_normal((rows, K)))
    out = host(np.full((rows, N), 0x7FC0, np.uint16))
    EmulatedQuantOps().gemv_w4_grouped(host(a), W4Weight.upload(pack_w4(w), host),
                                       host(np.array(experts, np.int32)), host(row_token), out, tile_m)
    deq = rb(fmt.dequant(w))
    for t, (c, e) in enumerate(zip(counts, experts)):
        got = np.asarray(out)[t * tile_m:(t + 1) * tile_m]
        if c:
            assert_bf16_close(got[:c], rb(f32(a[t * tile_m:t * tile_m + c]) @ deq[e].T), f"tile {t}")
        assert np.all(got[c:] == 0x7FC0)


@pytest.mark.parametrize("kind", ["fp16_zero", "fp4"])
def test_dequant_w4_is_the_load_time_dequantization_in_bf16(kind):
    """w4_dequant.cu (prefill's bf16 weights): bit for bit bf16(dequant(W)), experts one after another, N and K
    not multiples of the tile (33 rows, K 160) in a wider buffer (ld 168) whose extra columns stay untouched."""
    rng = np.random.default_rng(len(kind))
    E, N, K, ld = 2, 33, 160, 168
    w = random_w4(rng, kind, N, K, 32, (E,))
    out = host(np.full((E, N, ld), 0x7FC0, np.uint16))
    EmulatedQuantOps().dequant_w4(W4Weight.upload(pack_w4(w), host), out)
    np.testing.assert_array_equal(np.asarray(out)[..., :K], bf16(fmt.dequant(w)))
    assert np.all(np.asarray(out)[..., K:] == 0x7FC0)


def test_gemv_w4_refuses_bad_shapes():
    rng = np.random.default_rng(0)
    w = W4Weight.upload(pack_w4(random_w4(rng, "bf16", 16, 128, 32)), host)
    ops = EmulatedQuantOps()
    with pytest.raises(ValueError, match="1..16 rows"):
        ops.gemv_w4(host(np.zeros((17, 128), np.uint16)), w, host(np.zeros((17, 16), np.uint16)))
    with pytest.raises(ValueError, match=r"\[rows, 128\]"):
        ops.gemv_w4(host(np.zeros((2, 64), np.uint16)), w, host(np.zeros((2, 16), np.uint16)))
    with pytest.raises(ValueError, match="residual"):
        ops.gemv_w4(host(np.zeros((2, 128), np.uint16)), w, host(np.zeros((2, 16), np.uint16)), "residual")
