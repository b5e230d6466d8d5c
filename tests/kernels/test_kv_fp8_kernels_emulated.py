"""The FP8 KV cache's kernel entries on the host (tests/cuda_emulation.h), against numpy with memory/kv_format.py's
e4m3 (x / scale saturated, read e4m3 · scale): qk_norm_rope_cache_fp8 writes exactly the e4m3 of the bf16 entry's
keys and values (q unchanged); paged_decode_attention_fp8 attends over the dequantized cache (k_scale folded into
q, v_scale into the output); kv_gather_fp8 stages bf16(e4m3 · scale) exactly. On the GPU: tests/gpu/test_gpu_kv_fp8.py."""
from __future__ import annotations

import numpy as np
import pytest

from memory.kv_format import E4M3, dequantize_e4m3, quantize_e4m3
from test_decode_kernels_emulated import assert_bf16_close, decode_attention_args, paged_attention_reference, run
from test_deltanet_kernels_emulated import host
from test_rope_cache_emulated import bf16, f32, rb


def e4m3_cache(bits: np.ndarray, scale: float) -> np.ndarray:
    """A bf16 cache's values as the e4m3 bytes the FP8 cache holds."""
    return quantize_e4m3(f32(bits), scale).view(np.uint8)


@pytest.mark.parametrize("D,k_scale,v_scale", [(128, 0.004, 0.5), (64, 1.0, 1.0), (256, 0.004, 0.05)])
def test_rope_cache_writes_the_e4m3_of_the_bf16_entry(D, k_scale, v_scale):
    rng = np.random.default_rng(D)
    T, Hq, Hkv, slots = 4, 4, 2, 64
    qkv = bf16(2 * rng.standard_normal((T, (Hq + 2 * Hkv) * D)))
    norms = (host(bf16(1 + 0.2 * rng.standard_normal(D))), host(bf16(1 + 0.2 * rng.standard_normal(D))))
    inv_freq = (1.0 / (1e6 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    positions, slot_mapping = np.array([3, 17, 40, 2], np.int32), np.array([5, 33, -1, 60], np.int32)
    head = (host(qkv),) + norms + (np.float32(1e-6), host(inv_freq), np.float32(1.0), host(positions),
                                   host(slot_mapping))
    out = {}
    for fp8 in (False, True):
        q = host(np.zeros((T, Hq, D), np.uint16))
        kc, vc = (host(np.zeros((slots, Hkv, D), np.uint8 if fp8 else np.uint16)) for _ in range(2))
        shape = (np.int32(Hq), np.int32(Hkv), np.int32(D))
        scales = (np.float32(k_scale), np.float32(v_scale)) if fp8 else ()
        run("qk_norm_rope_cache", "qk_norm_rope_cache" + ("_fp8" if fp8 else ""), (T, 1), 256,
            head + (q, kc, vc) + shape + scales)
        out[fp8] = (np.array(q), np.array(kc), np.array(vc))
    np.testing.assert_array_equal(out[True][0], out[False][0])
    for plane, scale in ((1, k_scale), (2, v_scale)):
        np.testing.assert_array_equal(out[True][plane], e4m3_cache(out[False][plane], scale))
    assert not out[True][1][[2, 3, 4, 6]].any()                 # slots no token wrote (the padded token: -1)
    if k_scale < 0.1:
        assert (np.abs(out[True][1].view(E4M3).astype(np.float32)) == 448).any()      # saturated, not NaN


@pytest.mark.parametrize("D,group,heads,splits", [(128, 4, 4, 1), (128, 4, 2, 3), (64, 8, 8, 2), (256, 2, 1, 2)])
def test_decode_attention_reads_the_e4m3_cache(D, group, heads, splits):
    rng = np.random.default_rng(D * group + splits)
    Hkv, T, k_scale, v_scale = 2, 5, 0.02, 0.3
    Hq = group * Hkv
    tail, _, kc, vc, out = decode_attention_args(np.random.default_rng(3), T, Hq, Hkv, D, splits)
    k8, v8 = host(e4m3_cache(np.asarray(kc), k_scale)), host(e4m3_cache(np.asarray(vc), v_scale))
    q = bf16(2 * rng.standard_normal((T, Hq, D)))
    build = dict(GQA=group, HEAD_DIM=D, LORA_R=8, **({"HEADS": heads} if heads != group else {}))
    args = (host(q), k8, v8) + tail[2:] + (np.float32(k_scale), np.float32(v_scale))
    run("paged_decode", "paged_decode_attention_fp8", (T, splits, Hkv * (group // heads)), 128, args, **build)
    k = dequantize_e4m3(np.asarray(k8).view(E4M3), k_scale)
    v = dequantize_e4m3(np.asarray(v8).view(E4M3), v_scale)
    want = paged_attention_reference(f32(q), k, v, np.asarray(tail[2]), np.asarray(tail[5]))
    got = np.asarray(out).reshape(T, Hq, D)
    assert_bf16_close(got, rb(want), f"D {D}, GQA {group}, {heads} heads, {splits} splits")
    # the bf16 values of the same cache, read as if they were bf16, are far off: the test sees the format
    assert not np.allclose(f32(got), want * 2, rtol=0.1)


def test_gather_widens_to_bf16_exactly():
    rng = np.random.default_rng(5)
    Hkv, D, lens = 2, 64, [21, 40]
    width = max(-(-n // 16) for n in lens)
    tables = rng.permutation(16).astype(np.int32)[:2 * width].reshape(2, width)
    kc, vc = (quantize_e4m3(rng.standard_normal((16 * 16, Hkv, D)) * 3, 0.05).view(np.uint8) for _ in range(2))
    cu_k = np.array([0, lens[0], sum(lens)], np.int32)
    k_out, v_out = (host(np.zeros((sum(lens), Hkv, D), np.uint16)) for _ in range(2))
    run("kv_gather", "kv_gather_fp8", (width, 2), 256,
        (host(kc), host(vc), host(tables), np.int32(width), host(cu_k), k_out, v_out, np.int32(Hkv * D // 8),
         np.float32(0.05), np.float32(0.05)))
    for cache, got in ((kc, k_out), (vc, v_out)):
        want = np.concatenate([cache.reshape(-1, 16, Hkv, D)[tables[b]].reshape(-1, Hkv, D)[:n]
                               for b, n in enumerate(lens)])
        np.testing.assert_array_equal(np.asarray(got), bf16(dequantize_e4m3(want.view(E4M3), 0.05)))
