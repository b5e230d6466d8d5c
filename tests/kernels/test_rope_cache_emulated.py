"""qk_norm_rope_cache.cu on the host (tests/cuda_emulation.h, as test_deltanet_kernels_emulated): every launch
shape GpuOps uses (one block per token with one shared cos / sin table; head groups for short steps; fewer
threads than D/2 pairs; 16-byte pieces with a warp's lane groups on query, key and value heads at once and past
the last head, and a head dim of no piece form, 48) against a numpy reference of the same roundings (bf16 norm, bf16 rotation, cos and
sin of float32 angles), q to the query buffer, k and v to their cache slots, padding rows untouched.
On the GPU: tests/kernels/test_raw_cuda_kernels.py and the fused decode entry's bits (test_raw_cuda_rope_attention)."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from openinfer_kernels.raw_cuda.launch import pack_argument
from test_deltanet_kernels_emulated import emulated, host

POISON = 0x7FC1


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f32(bits) -> np.ndarray:
    return np.asarray(bits).view(ml_dtypes.bfloat16).astype(np.float32)


def rb(x) -> np.ndarray:
    return f32(bf16(x))


def launch(grid, threads, args):
    values = [pack_argument(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    emulated("qk_norm_rope_cache").emu_qk_norm_rope_cache(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
                                                          ctypes.c_uint(1), ctypes.c_uint(threads), ctypes.c_size_t(0),
                                                          params)


def reference(qkv, qn, kn, eps, inv_freq, factor, pos, Hq, Hkv, D):
    x = f32(qkv).reshape(len(pos), Hq + 2 * Hkv, D)
    half = D // 2
    ang = pos[:, None].astype(np.float32) * inv_freq[None, :]
    c, s = (np.cos(ang).astype(np.float32) * np.float32(factor))[:, None], (np.sin(ang).astype(np.float32) * np.float32(factor))[:, None]

    def norm(a, w):
        if w is None:
            return a
        rstd = 1 / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps)
        return rb(f32(w) * rb(a * rstd))

    def rope(a):
        lo, hi = a[..., :half], a[..., half:]
        return rb(np.concatenate([lo * c - hi * s, hi * c + lo * s], -1))
    return rope(norm(x[:, :Hq], qn)), rope(norm(x[:, Hq:Hq + Hkv], kn)), x[:, Hq + Hkv:]


@pytest.mark.parametrize("D,Hq,Hkv,grid_y,threads,qk_norm", [
    (128, 8, 2, 1, 256, True), (128, 8, 2, 2, 256, True), (64, 4, 4, 3, 128, False), (256, 4, 1, 1, 64, True),
    (16, 2, 1, 1, 32, False), (64, 6, 1, 1, 64, True), (128, 5, 1, 2, 64, True), (48, 4, 2, 1, 64, True)])
def test_rope_cache_kernel_matches_numpy(D, Hq, Hkv, grid_y, threads, qk_norm):
    rng = np.random.default_rng(D + Hq + grid_y)
    T, eps, slots, factor = 5, 1e-6, 16, 1.25
    qkv = bf16(rng.standard_normal((T, (Hq + 2 * Hkv) * D)))
    qn, kn = (bf16(1 + 0.2 * rng.standard_normal(D)) for _ in range(2)) if qk_norm else (None, None)
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    pos = rng.integers(0, 30000, T).astype(np.int32)
    slot = rng.permutation(slots)[:T].astype(np.int32)
    slot[2] = -1                                               # padding: nothing written
    q_out = host(np.full((T, Hq, D), POISON, np.uint16))
    kc, vc = (host(np.full((slots, Hkv, D), POISON, np.uint16)) for _ in range(2))
    null = np.uint64(0)
    launch((T, grid_y), threads, (host(qkv), host(qn) if qk_norm else null, host(kn) if qk_norm else null,
                                  np.float32(eps), host(inv_freq), np.float32(factor), host(pos), host(slot), q_out,
                                  kc, vc, np.int32(Hq), np.int32(Hkv), np.int32(D)))
    q_ref, k_ref, v = reference(qkv, qn, kn, eps, inv_freq, factor, pos, Hq, Hkv, D)
    # host sin / cos and numpy's may differ in the last float bit: compare to one bf16 step
    np.testing.assert_allclose(f32(q_out), q_ref, rtol=1e-2, atol=1e-2)
    for t in range(T):
        if slot[t] < 0:
            continue
        np.testing.assert_allclose(f32(kc[slot[t]]), k_ref[t], rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(np.asarray(vc[slot[t]]), bf16(v[t]))
    untouched = np.setdiff1d(np.arange(slots), slot[slot >= 0])
    assert np.all(np.asarray(kc)[untouched] == POISON) and np.all(np.asarray(vc)[untouched] == POISON)
    # most values equal the reference's bits exactly (the roundings are the same)
    assert np.mean(np.asarray(q_out) == bf16(q_ref)) > 0.97
