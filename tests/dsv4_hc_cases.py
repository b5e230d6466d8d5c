"""DeepSeek-V4's hyper-connection kernels (dsv4_hc.cu through GpuDSV4Ops.hyper_connection / hc_merge /
hyper_head) against the numpy reference (engine/executor/cpu_dsv4_ops.py, itself checked against transformers'
modules in tests/models/test_dsv4_parts.py), on random inputs: shared by the host emulation
(tests/kernels/test_dsv4_hc_emulated.py) and the device test (tests/gpu/test_gpu_dsv4_hc.py). `dev` puts a
host array where the ops read it, `back` brings one back.

Tolerances. post / comb: float32 math in another order (the mixes' products split over CTAs and threads,
rstd factored out of the products, fused multiply-adds, the device's expf): rtol 1e-5, ~100 float32 ulps
(measured in the emulation: 2.1e-6 at V4-Flash's width, 4e-7 at the tiny one's), while a wrong term (a
transposed comb, the eps misplaced, the Sinkhorn stopped at 5 of 20 iterations) moves them by 1e-3 or more.
The merged streams: an error of at most 1e-5 of the sum of their terms' magnitudes (the terms cancel;
measured 1.3e-6). The collapsed block input and the head's are bf16: the kernel and the reference round
float32 sums that differ in their last bits, so a value may land one bf16 step (2^-7 relative at most) away;
at least 99% must be equal (measured 99.99%).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.executor import cpu_dsv4_ops as v4

# (tokens, hc_mult, hidden): the tiny models' (hc_mult 1..3, hidden 64), an uneven split (N·D = 1200: two CTAs,
# the second short), hc_mult 5 (the kernels' limit), DeepSeek-V4-Flash's width (4 streams of 4096: 16 CTAs a row)
SHAPES = [(3, 3, 64), (2, 1, 64), (4, 2, 600), (2, 5, 256), (3, 4, 4096)]
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f32(bits) -> np.ndarray:
    return np.asarray(bits).view(ml_dtypes.bfloat16).astype(np.float32)


@dataclass
class HCInputs:
    streams: np.ndarray         # float32 [T, N, D]
    fn: np.ndarray              # bf16 bits [(2 + N)·N, N·D]
    base: np.ndarray            # bf16 bits [(2 + N)·N]
    scale: np.ndarray           # bf16 bits [3]
    head_fn: np.ndarray         # bf16 bits [N, N·D]
    head_base: np.ndarray       # bf16 bits [N]
    head_scale: np.ndarray      # bf16 bits [1]
    out_f32: np.ndarray         # a block's float32 output [T, D] (the attention's)
    out_bf16: np.ndarray        # a block's bf16 output [T, D] (the MoE's)


def random_inputs(T: int, N: int, D: int, seed: int) -> HCInputs:
    """Weights as test_dsv4_parts randomizes transformers' modules (fn std 1.5 / sqrt(N·D): mixes of order 1)."""
    rng = np.random.default_rng(seed)
    M, ND = (2 + N) * N, N * D

    def w(*shape, std=1.0):
        return bf16(std * rng.standard_normal(shape))

    return HCInputs(streams=(rng.standard_normal((T, N, D)) * rng.uniform(0.2, 3, (T, N, 1))).astype(np.float32),
                    fn=w(M, ND, std=1.5 / ND ** 0.5), base=w(M), scale=w(3), head_fn=w(N, ND, std=1.5 / ND ** 0.5),
                    head_base=w(N), head_scale=w(1), out_f32=rng.standard_normal((T, D)).astype(np.float32),
                    out_bf16=w(T, D))


def run_kernels(ops, inp: HCInputs, dev, back, iters: int = ITERS) -> dict:
    """The three ops on the inputs: post, comb, the collapsed input, the merged streams (both block output
    dtypes) and the head's collapse, as numpy arrays."""
    streams = dev(inp.streams)
    post, comb, x = ops.hyper_connection(streams, dev(inp.fn), dev(inp.base), dev(inp.scale), iters, HC_EPS, NORM_EPS)
    return {"post": back(post), "comb": back(comb), "collapsed": back(x),
            "merged_f32": back(ops.hc_merge(dev(inp.out_f32), streams, post, comb)),
            "merged_bf16": back(ops.hc_merge(dev(inp.out_bf16), streams, post, comb)),
            "head": back(ops.hyper_head(streams, dev(inp.head_fn), dev(inp.head_base), dev(inp.head_scale), HC_EPS,
                                        NORM_EPS))}


def reference(inp: HCInputs) -> dict:
    """cpu_dsv4_ops on the same values (the weights' bf16 values in float32); merged_*_size: the sum of its
    terms' magnitudes, which its float32 error scales with (the terms cancel)."""
    s = inp.streams
    pre, post, comb = v4.hc_weights(v4.hc_mix(s, f32(inp.fn), NORM_EPS), f32(inp.base), f32(inp.scale), ITERS, HC_EPS)
    want = {"post": post, "comb": comb, "collapsed": v4.hc_collapse(pre, s),
            "head": v4.hyper_head(s, f32(inp.head_fn), f32(inp.head_base), f32(inp.head_scale), HC_EPS, NORM_EPS)}
    for name, out in (("merged_f32", inp.out_f32), ("merged_bf16", f32(inp.out_bf16))):
        want[name] = v4.hc_merge(out, s, post, comb)
        want[name + "_size"] = v4.hc_merge(np.abs(out), np.abs(s), post, comb)
    return want


def check(got: dict, want: dict) -> None:
    """got's outputs (all of run_kernels' or some) against the reference's."""
    assert got, "nothing to check"
    for name in {"post", "comb"} & got.keys():
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for name in {"merged_f32", "merged_bf16"} & got.keys():
        err = np.abs(got[name] - want[name]) / want[name + "_size"]
        assert err.max() <= 1e-5, (name, err.max())
    for name in {"collapsed", "head"} & got.keys():
        assert got[name].dtype == np.uint16, name
        g = f32(got[name])
        np.testing.assert_allclose(g, want[name], rtol=2 ** -7, atol=1e-6, err_msg=name)
        assert np.mean(g == f32(bf16(want[name]))) >= 0.99, name
