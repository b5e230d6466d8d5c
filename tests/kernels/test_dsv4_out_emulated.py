"""DeepSeek-V4's grouped output projection on the GPU ops (GpuDSV4Ops.grouped_linear over the MoE part's
moe_gemv.cu and moe_grouped_gemm.cu, no CuTe library) run on the host, without a GPU (tests/cuda_emulation.h),
against the numpy definition: the cases and bound of tests/dsv4_out_cases.py (V4-Flash's cut: emulated_shape);
the check fails with the groups' weights swapped; the quantized MoE part takes the bf16 path; out_projection
makes no float32 copy of wo_a. Skipped without g++ or the CUDA headers; test_gpu_dsv4_out.py runs the same cases
on the device (the CuTe grouped GEMM too)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from dsv4_indexer_cases import bf16, f32
from dsv4_out_cases import CASES, TOKENS, check, random_inputs, reference, run
from test_deltanet_kernels_emulated import host
from test_dsv4_hc_emulated import EmulatedDSV4, EmulatedHCShared

from engine.executor.cpu_dsv4_attention import out_projection
from engine.executor.gpu_dsv4_ops import WEIGHT_F32_CACHE, GpuDSV4Ops
from engine.executor.gpu_moe_ops import COMBINE_COLS, GEMV_MAX_TOKENS, MOE_UNROLL, GpuMoEOps
from engine.executor.gpu_quant_moe import GpuQuantMoEOps


def product_kernels() -> dict:
    """GpuMoEOps' grouped products and activations as the host emulation launches them (k_gemv, k_grouped,
    k_silu, k_silu_limited)."""
    gemv = (("COMBINE_COLS", COMBINE_COLS), ("MOE_UNROLL", MOE_UNROLL))
    return {"k_gemv": ("moe_gemv", "moe_gemv", gemv), "k_grouped": ("moe_grouped_gemm", "moe_grouped_gemm", ()),
            "k_silu": ("silu_mul", "silu_mul", ()), "k_silu_limited": ("silu_mul", "silu_mul_limited", ())}


class EmulatedGemm:
    """The bf16 GEMM (float32 products of bf16 values) and no CuTe library: grouped products on moe_grouped_gemm.cu."""
    cute = None

    def __call__(self, x, w, out, **_) -> None:
        y = f32(x) @ f32(w).T
        out[...] = y if out.dtype == np.float32 else bf16(y)


class EmulatedGroupedMoE(GpuMoEOps):
    """GpuMoEOps' grouped products in the host emulation."""

    def __init__(self, shared):
        self.shared, self.cp = shared, np
        self.__dict__.update(product_kernels())


class EmulatedQuantMoE(GpuQuantMoEOps):
    """The MoE part of a model keeping quantized experts (its quantized kernels never reached here)."""

    def __init__(self, shared):
        self.shared, self.cp, self.quant = shared, np, SimpleNamespace(pdl=False)
        self.__dict__.update(product_kernels())


def emulated_ops(moe_class=EmulatedGroupedMoE) -> EmulatedDSV4:
    shared = EmulatedHCShared()
    shared.gemm = EmulatedGemm()
    return EmulatedDSV4(shared, moe_class(shared))


def emulated_shape(case, tokens: int) -> tuple[int, int, int]:
    """(groups, N, K) of a case in the emulation: V4-Flash's 8 groups of 4096 inputs with the outputs cut to 32
    (one column CTA: the others are alike) and, on the grouped GEMM (more than GEMV_MAX_TOKENS tokens), the inputs
    to 512 (its k loop is alike; the emulation's mma takes ~1 s a 64 x 64 x 4096 tile). The device test runs them
    whole."""
    _, groups, n, k = case
    return (groups, min(n, 32), k if tokens <= GEMV_MAX_TOKENS else min(k, 512))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_grouped_projection_matches_numpy(case, tokens):
    inp = random_inputs(*emulated_shape(case, tokens), tokens, seed=tokens)
    check(run(emulated_ops(), inp, host, np.asarray), reference(inp))


@pytest.mark.parametrize("tokens", [3, 32])
def test_the_quantized_moe_part_takes_the_bf16_path(tokens):
    """With quantized experts kept (GpuQuantMoEOps), wo_a's bf16 weight falls through to the bf16 grouped
    products: the same bits."""
    inp = random_inputs(*CASES[0][1:], tokens, seed=5)
    np.testing.assert_array_equal(run(emulated_ops(EmulatedQuantMoE), inp, host, np.asarray),
                                  run(emulated_ops(), inp, host, np.asarray))


def test_bf16_activations_give_the_float32_ones_bits():
    """x already bf16 (as mm takes it) is laid out as it is: the same bits as its float32 values rounded."""
    inp = random_inputs(*CASES[0][1:], 3, seed=4)
    as_bits = SimpleNamespace(groups=inp.groups, x=bf16(inp.x), w=inp.w)
    np.testing.assert_array_equal(run(emulated_ops(), as_bits, host, np.asarray),
                                  run(emulated_ops(), inp, host, np.asarray))


def test_the_check_fails_with_the_groups_swapped():
    """The check can fail: the product against the numpy one with the two groups' weights swapped."""
    inp = random_inputs(*CASES[0][1:], 3, seed=1)
    got = run(emulated_ops(), inp, host, np.asarray)
    swapped = SimpleNamespace(groups=2, x=inp.x, w=np.concatenate(np.split(inp.w, 2)[::-1]))
    with pytest.raises(AssertionError):
        check(got, reference(swapped))


@pytest.mark.parametrize("shape", [CASES[0][1:], (8, 160, 4096)], ids=["tiny", "v4_flash_groups"])
def test_out_projection_makes_no_float32_copy_of_wo_a(shape):
    """Two steps' out_projection convert nothing of wo_a's size to float32 and keep no float32 form of it: the
    einsum over GpuDSV4Ops.fp32(wo_a) kept the tiny model's and converted every step one past WEIGHT_F32_CACHE
    (V4-Flash's 8 groups of 4096 inputs, 160 outputs a group here; its 1024 are 33.5M values)."""
    groups, n, k = shape
    inp = random_inputs(groups, n, k, 1, seed=2)
    assert shape == CASES[0][1:] or inp.w.size > WEIGHT_F32_CACHE
    heads, hidden = 4, 64
    w = {"layers.0.wo_a": host(inp.w), "layers.0.wo_b": host(bf16(np.ones((hidden, groups * n)) / groups / n))}
    ops, converted = emulated_ops(), []

    def counted(a):
        converted.append(a.size)
        return GpuDSV4Ops._f(ops, a)

    ops._f = counted
    at, spec = host(np.zeros(1, np.int32)), SimpleNamespace(layer=0, o_groups=groups, inv_freq=np.ones(4, np.float32))
    for _ in range(2):      # position 0: the rope undone is the identity
        y = out_projection(host(inp.x.reshape(1, heads, -1)), at, w, spec, ops)
    want = f32(bf16(reference(inp)[0])) @ f32(w["layers.0.wo_b"]).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-2, atol=1e-4)
    assert max(converted) < inp.w.size, converted
    assert not any(kept is w["layers.0.wo_a"] for kept, _ in ops._kept_weights.values())
