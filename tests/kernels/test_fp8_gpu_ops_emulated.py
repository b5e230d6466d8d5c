"""The GPU's quantized-linear parts on the host emulation of their kernels: FP8 W8A8
(engine/executor/gpu_fp8_ops.py GpuFp8Linear: fp8_quant.cu, gemv_fp8.cu, silu_mul.cu, add_bias.cu; launched
exactly as on the GPU), against the numpy executor's W8A8 product (cpu_quant_ops.w8a8_linear) up to one bf16 rounding: decode rows, and larger steps
through the GEMV 16 rows at a time (the path without the CuTe library; the CuTe FP8 GEMM itself is checked on
the GPU, tests/kernels/test_gpu_quant_kernels.py and tests/gpu/test_gpu_quantized_linear.py); block and channel scales; the
RMSNorm fused before the quantization; the residual and SiLU·up epilogues, on gate_up rows interleaved
(channel scales) and not (block scales). INT4 W4A16 (gpu_w4_linear.py GpuW4Linear): gemv_w4.cu and
w4_dequant.cu's bf16 scratch against the exactly dequantized weights, gate_up rows interleaved at upload or not."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from engine.executor.cpu_quant_ops import w8a8_linear
from engine.executor.gpu_fp8_ops import Fp8Device, GpuFp8Linear, fp8_host_arrays
from engine.executor.gpu_gemm import interleave_gate_up
from engine.executor.gpu_w4_linear import GpuW4Linear, interleaved_codes
from engine.models.quant_linear import Fp8Linear, W4Linear, fp8_per_channel
from harness.quant_cases import random_w4
from harness.quantized import quantize_fp8_block
from openinfer_kernels.quant.ops import W4Weight
from openinfer_kernels.quant.w4_layout import pack_w4
from test_decode_kernels_emulated import assert_bf16_close
from test_deltanet_kernels_emulated import EmulatedShared, host
from test_quant_w4 import EmulatedQuantOps
from test_rope_cache_emulated import bf16, f32, rb

N, K, EPS = 256, 384, 1e-6


class Gemm:
    """The bf16 GEMM's stand-in: no CuTe; records the buffers marked rewritten (no early weight loads)."""
    cute = None

    def __init__(self):
        self.rewritten = []

    def mark_rewritten(self, buffer) -> None:
        self.rewritten.append(buffer)


class Shared(EmulatedShared):
    stream = None

    def __init__(self, interleaved: bool):
        self.gate_up_interleaved = interleaved
        self.gemm = Gemm()


class Arena:
    def take_all(self, prefix, buffers):
        return {b.name: host(np.zeros(b.shape, b.dtype)) for b in buffers}


class EmulatedFp8Linear(GpuFp8Linear):
    quant_ops_class = EmulatedQuantOps

    def _kernel(self, name, entry):
        return name, entry, ()


def part(interleaved: bool = False) -> EmulatedFp8Linear:
    plan = SimpleNamespace(linear_shapes=((N, K), (K, N)), max_tokens=64)
    return EmulatedFp8Linear(plan, Shared(interleaved), Arena())


def weight(channel: bool, seed: int = 0) -> Fp8Linear:
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    return fp8_per_channel(w) if channel else Fp8Linear(*quantize_fp8_block(w, (128, 128)))


def device(w: Fp8Linear, interleave: bool = False) -> Fp8Device:
    a = fp8_host_arrays(w, interleave)
    return Fp8Device(host(a["codes"]), host(a["scale"]), host(a["block_scale"]), w.channel)


def activations(T: int, seed: int = 1) -> np.ndarray:
    return bf16(np.random.default_rng(seed).standard_normal((T, K)) * 2)


def rms_norm_bits(x, w) -> np.ndarray:
    """rms_norm.cu's rounding: bf16(w · bf16(x · rsqrt(mean(x²) + eps)))."""
    r = f32(x)
    n = rb(r / np.sqrt(np.mean(r * r, -1, keepdims=True) + np.float32(EPS)))
    return bf16(f32(w) * n)


@pytest.mark.parametrize("T", [1, 5, 16, 37])
@pytest.mark.parametrize("channel", [False, True])
def test_product_is_the_numpy_w8a8(channel, T):
    w, x = weight(channel), activations(T)
    out = host(np.zeros((T, N), np.uint16))
    part().run(host(x), device(w), out)
    want = w8a8_linear(f32(x), w)
    assert_bf16_close(out, rb(want), f"channel={channel} T={T}")
    assert np.abs(f32(out) - rb(f32(x) @ np.asarray(w).T)).max() > 1e-3      # the activations' quantization shows


@pytest.mark.parametrize("T", [3, 20])
def test_rms_norm_fused_before_the_quantization(T):
    w, x = weight(False), activations(T)
    norm = bf16(np.random.default_rng(2).uniform(0.5, 1.5, K))
    out = host(np.zeros((T, N), np.uint16))
    part().run(host(x), device(w), out, norm_w=host(norm), eps=EPS)
    assert_bf16_close(out, rb(w8a8_linear(f32(rms_norm_bits(x, norm)), w)), f"norm T={T}")


@pytest.mark.parametrize("T", [2, 19])
def test_residual_epilogue(T):
    """out = bf16(product) + residual, in place (the residual stream's buffer)."""
    w, x = weight(True), activations(T)
    res = bf16(np.random.default_rng(3).standard_normal((T, N)))
    out = host(res.copy())
    part().run(host(x), device(w), out, "residual", res=out)
    assert_bf16_close(out, rb(rb(w8a8_linear(f32(x), w)) + f32(res)), f"residual T={T}")


def silu(g):
    return g / (1 + np.exp(-g))


@pytest.mark.parametrize("T", [4, 18])
@pytest.mark.parametrize("channel", [False, True])
def test_swiglu_epilogue(channel, T):
    """Channel scales: gate_up interleaved by 8 (gemv_fp8's SiLU·up epilogue); block scales: not (silu_mul.cu)."""
    w, x = weight(channel), activations(T)
    out = host(np.zeros((T, N // 2), np.uint16))
    part(interleaved=channel).run(host(x), device(w, interleave=channel), out, "silu")
    y = rb(w8a8_linear(f32(x), w))
    assert_bf16_close(out, rb(rb(silu(y[:, :N // 2])) * y[:, N // 2:]), f"silu channel={channel} T={T}")  # silu_times


def test_block_scaled_gate_up_is_not_interleaved():
    with pytest.raises(ValueError, match="not interleaved"):
        fp8_host_arrays(weight(False), interleave=True)


# ---- the int4 part (engine/executor/gpu_w4_linear.py) -------------------------------------------------------
class EmulatedW4Linear(GpuW4Linear):
    quant_ops_class = EmulatedQuantOps


def w4_device(w4):
    return W4Weight.upload(pack_w4(w4), host)


@pytest.mark.parametrize("kind", ["fp16_zero", "bf16"])
@pytest.mark.parametrize("interleave", [False, True])
def test_w4_part_decode_and_prefill_weights(kind, interleave):
    """gemv_w4 (decode rows; SiLU·up on rows interleaved at upload) and the bf16 scratch of w4_dequant.cu
    (larger steps) against the exactly dequantized weights."""
    w4 = random_w4(np.random.default_rng(4), kind, N, K, 128)
    want_w = W4Linear(w4).dequantized()
    w = w4_device(interleaved_codes(w4) if interleave else w4)
    p = EmulatedW4Linear(SimpleNamespace(linear_shapes=((N, K),), max_tokens=64), Shared(interleave), Arena())
    # w4_dequant writes the scratch just before each product: the GEMM must not load its tiles early (PDL)
    assert len(p.shared.gemm.rewritten) == 1 and p.shared.gemm.rewritten[0] is p.scratch
    np.testing.assert_array_equal(f32(p.bf16(w)), (interleave_gate_up(want_w) if interleave else want_w)
                                  .astype(ml_dtypes.bfloat16).astype(np.float32))
    x = activations(5)
    y = rb(f32(x) @ rb(want_w).T)                    # the kernels multiply the bf16 rounding of the weights
    if interleave:
        out = host(np.zeros((5, N // 2), np.uint16))
        p.gemv(host(x), w, out, "silu")
        assert_bf16_close(out, rb(rb(silu(y[:, :N // 2])) * y[:, N // 2:]), f"w4 silu {kind}")
    else:
        out = host(np.zeros((5, N), np.uint16))
        p.gemv(host(x), w, out)
        assert_bf16_close(out, y, f"w4 {kind}")
