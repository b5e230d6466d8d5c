"""The GPU's routed experts kept quantized (engine/executor/gpu_quant_moe.py GpuQuantMoEOps) on the host emulation of
their kernels (moe_align, moe_gather, fp8_quant + gemv_fp8_grouped / gemv_w4_grouped, silu_mul, moe_combine; launched
exactly as on the GPU), against the numpy executor's experts on the same kept weights (NumpyMoEOps: W8A8 per
expert, or the 4-bit weights as the kernels dequantize them), up to the bf16 roundings of the grouped rows: decode
and prefill-sized steps, block- and channel-scaled FP8, int4 with bf16 scales and FP4, gate_up interleaved and not.
Skipped without g++ or the CUDA headers."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from test_deltanet_kernels_emulated import host
from test_moe_route_emulated import ExpertsShared
from test_quant_w4 import EmulatedQuantOps

from engine.executor.cpu_moe_ops import NumpyMoEOps, route_topk
from engine.executor.cpu_quant_ops import host_fp8
from engine.executor.gpu_gemm import interleave_gate_up
from engine.executor.gpu_quant_moe import (FP8_GEMM_ROWS, W4_GEMM_ROWS, Fp8ExpertsDevice, GpuQuantMoEOps,
                                           grouped_gemm_tokens)
from engine.executor.gpu_w4_linear import interleaved_codes
from engine.models.ops import RouteSpec
from engine.models.quant_experts import Fp8Experts, W4Experts
from engine.models.quant_linear import Fp8Linear, W4Linear, fp8_per_channel
from harness.quant_cases import random_w4
from harness.quantized import quantize_fp8_block
from openinfer_kernels.quant.ops import W4Weight
from openinfer_kernels.quant.w4_formats import W4Codes, ue8m0_to_bf16_bits
from openinfer_kernels.quant.w4_layout import pack_w4

E, H, INTER = 4, 256, 128
SPEC = RouteSpec(E, 2, renormalize=True)


class EmulatedQuantMoE(GpuQuantMoEOps):
    """GpuQuantMoEOps with its launches on the host emulation and its buffers in host memory."""

    def __init__(self, tokens: int, interleaved: bool):
        plan = SimpleNamespace(max_tokens=tokens, fp8_experts=True, experts=SimpleNamespace(
            num_experts=E, top_k=SPEC.top_k, hidden=H, inter=INTER))
        self.shared = ExpertsShared(tokens, H)
        self.shared.gate_up_interleaved = interleaved
        self.buf = {b.name: host(np.zeros(b.shape, b.dtype)) for b in self.buffers(plan)}
        for name, file in (("align", "moe_align"), ("gather", "moe_permute"), ("combine", "moe_permute")):
            setattr(self, f"k_{name}", (file, "moe_" + name, ()))
        self.k_silu = ("silu_mul", "silu_mul", ())
        self.quant = RecordingQuantOps()
        self.gemm_tokens = {W4Weight: grouped_gemm_tokens(E, SPEC.top_k, W4_GEMM_ROWS),
                            Fp8ExpertsDevice: grouped_gemm_tokens(E, SPEC.top_k, FP8_GEMM_ROWS)}


class RecordingQuantOps(EmulatedQuantOps):
    """EmulatedQuantOps that keeps the entries it launched (which path a step took)."""

    def __init__(self):
        super().__init__()
        self.entries: list[str] = []

    def _launch(self, k, grid, block, args):
        self.entries.append(k[1])
        super()._launch(k, grid, block, args)


def fp8_experts(rng, N: int, K: int, channel: bool) -> Fp8Experts:
    ws = [rng.standard_normal((N, K)).astype(np.float32) * 0.06 for _ in range(E)]
    parts = [fp8_per_channel(w) if channel else Fp8Linear(*quantize_fp8_block(w, (128, 128))) for w in ws]
    return Fp8Experts(np.stack([p.codes for p in parts]), np.stack([p.scale for p in parts]))


def device_weight(w, interleave: bool):
    """w as upload_quantized puts it on the device (host memory here)."""
    if isinstance(w, W4Experts):
        return W4Weight.upload(pack_w4(interleaved_codes(w.w4) if interleave else w.w4), host)
    codes, scale = np.asarray(w.codes).view(np.uint8), w.scale
    if interleave:
        codes, scale = interleave_gate_up(codes), interleave_gate_up(scale[..., None])[..., 0]
    return Fp8ExpertsDevice(host(codes), host(scale))


def small(w: W4Codes) -> W4Codes:
    """FP4 codes with scales 2^-9 .. 2^-4 (random_w4's reach 2^3: activations past bf16's useful range)."""
    if not w.fp4:
        return w
    e = np.random.default_rng(w.codes.size).integers(118, 124, w.scales.shape).astype(np.uint8)
    return W4Codes(w.codes, ue8m0_to_bf16_bits(e), w.scale_dtype, None, w.group, fp4=True)


def numpy_weight(w):
    """w as the numpy executor prepares it (engine/executor/cpu.py)."""
    return host_fp8(w) if isinstance(w, Fp8Experts) else w.dequantized()


def run_both(tokens: int, gate_up, down, interleaved: bool, seed: int,
             entries: list | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the GPU ops' output, the numpy executor's expert delta, the residual); `entries` gets the quantized
    kernels' entries launched."""
    rng = np.random.default_rng(seed)
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    x, residual = bf(rng.standard_normal((tokens, H))), bf(rng.standard_normal((tokens, H)))
    weights, ids = route_topk(rng.standard_normal((tokens, E)).astype(np.float32), SPEC)
    ops = EmulatedQuantMoE(tokens, interleaved)
    if entries is not None:
        ops.quant.entries = entries
    got = ops.experts(host(x.view(np.uint16)), device_weight(gate_up, interleaved), device_weight(down, False),
                      host(weights), host(ids.astype(np.int32)), host(residual.view(np.uint16)))
    got = np.asarray(got).view(ml_dtypes.bfloat16).astype(np.float32)
    silu_mul = lambda gu: gu[:, :INTER] / (1 + np.exp(-gu[:, :INTER])) * gu[:, INTER:]  # noqa: E731
    want = NumpyMoEOps(silu_mul).experts(x.astype(np.float32), numpy_weight(gate_up), numpy_weight(down), weights,
                                         ids, residual.astype(np.float32))
    return got, want - residual.astype(np.float32), residual.astype(np.float32)


def assert_experts_close(got, delta, residual) -> None:
    """got = bf16(residual + delta) up to the bf16 roundings of the grouped rows (and, for FP8, of the e4m3 codes
    of activations rounded to bf16 first): a relative error of a few parts in a thousand, where a wrong scale,
    expert or row would be of order one."""
    err = np.linalg.norm(got - residual - delta) / np.linalg.norm(delta)
    assert err < 2e-2, err


@pytest.mark.parametrize("tokens", [1, 40, 130])
@pytest.mark.parametrize("channel", [False, True])
def test_fp8_experts_match_numpy_w8a8(tokens, channel):
    """Decode and short prefills on gemv_fp8_grouped, a prefill whose experts average FP8_GEMM_ROWS rows or more
    on fp8_grouped_gemm."""
    rng = np.random.default_rng(tokens + 100 * channel)
    gate_up, down = fp8_experts(rng, 2 * INTER, H, channel), fp8_experts(rng, H, INTER, channel)
    entries = []
    assert_experts_close(*run_both(tokens, gate_up, down, interleaved=channel, seed=tokens, entries=entries))
    gemm = tokens >= grouped_gemm_tokens(E, SPEC.top_k, FP8_GEMM_ROWS)
    product = "fp8_grouped_gemm" if gemm else "gemv_fp8_grouped"
    assert entries == ["fp8_quant", product] * 2


@pytest.mark.parametrize("tokens", [1, 40, 130])
@pytest.mark.parametrize("kind", ["bf16", "fp4"])
def test_w4_experts_match_numpy(tokens, kind):
    """Decode and short prefills on gemv_w4_grouped, a prefill whose experts average W4_GEMM_ROWS rows or more on
    w4_grouped_gemm."""
    rng = np.random.default_rng(tokens + 7 * len(kind))
    gate_up, down = (W4Experts(small(random_w4(rng, kind, n, k, 32, (E,)))) for n, k in ((2 * INTER, H), (H, INTER)))
    entries = []
    got, delta, residual = run_both(tokens, gate_up, down, interleaved=tokens > 1, seed=tokens, entries=entries)
    assert_experts_close(got, delta, residual)
    gemm = tokens >= grouped_gemm_tokens(E, SPEC.top_k, W4_GEMM_ROWS)         # 48 tokens: 24 rows an expert
    assert entries == ["w4_grouped_gemm" if gemm else "gemv_w4_grouped"] * 2


def test_a_wrong_expert_scale_is_caught():
    """The gate's power: the FP8 experts with one expert's block scales swapped for another's fail it."""
    rng = np.random.default_rng(9)
    gate_up, down = fp8_experts(rng, 2 * INTER, H, False), fp8_experts(rng, H, INTER, False)
    swapped = Fp8Experts(gate_up.codes, gate_up.scale[[1, 0, 2, 3]] * np.float32(1.5))
    got, delta, residual = run_both(6, gate_up, down, interleaved=False, seed=6)
    bad, _, _ = run_both(6, swapped, down, interleaved=False, seed=6)
    assert_experts_close(got, delta, residual)
    with pytest.raises(AssertionError):
        assert_experts_close(bad, delta, residual)


class DeviceArray(np.ndarray):
    """A host array with CuPy's set (what the uploads call)."""

    def set(self, a, stream=None):
        self[...] = a


class Arena:
    def take(self, name, shape, dtype):
        return np.zeros(shape, dtype).view(DeviceArray)


class Stream:
    def synchronize(self):
        pass


@pytest.mark.parametrize("interleave", [False, True])
def test_uploads_hold_the_experts_as_the_kernels_read_them(interleave):
    """upload_quantized's expert uploads (4-bit: packed one expert at a time; FP8: codes and scales) hold what the
    kernels' tests feed them: pack_w4 of the whole stack (rows interleaved where asked), the e4m3 bits and scales."""
    from engine.executor.gpu_quant_ops import upload_quantized
    rng = np.random.default_rng(3)
    w4 = W4Experts(random_w4(rng, "fp16_zero", 2 * INTER, H, 64, (E,)))
    fp8 = fp8_experts(rng, 2 * INTER, H, channel=interleave)
    dense = W4Linear(random_w4(rng, "bf16", 2 * INTER, H, 32))
    dev = upload_quantized(Arena(), {"layers.0.experts_gate_up_proj": w4, "layers.1.experts_gate_up_proj": fp8,
                                     "layers.0.gate_up_proj": dense}, Stream(), lambda name: interleave)
    for name, w in (("layers.0.experts_gate_up_proj", w4), ("layers.0.gate_up_proj", dense)):
        got = dev[name]
        want = W4Weight.upload(pack_w4(interleaved_codes(w.w4) if interleave else w.w4), host)
        assert (got.experts, got.n, got.k, got.group, got.defines) == (want.experts, want.n, want.k, want.group,
                                                                       want.defines)
        for part in ("codes", "scales", "zeros"):
            np.testing.assert_array_equal(getattr(got, part), getattr(want, part))
    got, want = dev["layers.1.experts_gate_up_proj"], device_weight(fp8, interleave)
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.scale, want.scale)
