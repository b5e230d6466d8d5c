"""MLA's FP8 latent cache (--kv-cache-dtype fp8) kernel by kernel on the host (tests/cuda_emulation.h), against
numpy with memory/kv_format.py's e4m3 (x / k_scale saturated, read e4m3 · k_scale):
  * mla_latent_cache_fp8 and mla_absorb_q_cache_fp8 store exactly the e4m3 of the bf16 entries' rows (queries
    unchanged, padding slots unwritten);
  * mla_gather_latent_fp8 / mla_expand_kv_fp8 (the expanded prefill) read exactly bf16(e4m3 · k_scale);
  * mla_decode.cu built with KV_FP8=1 attends over the dequantized cache (k_scale folded into the query and the
    output), and the bf16 build over the bf16 cache, both against a numpy definition of the absorbed attention,
    with 16- and 8-byte row pieces (V2's 512 + 64 row and the tiny lines' 32 + 8) and split contexts.
On the GPU the line runs them end to end: tests/gpu/test_gpu_kv_fp8.py (the deepseek_v3 gate)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.executor.gpu_mla_ops import mla_decode_smem
from memory.kv_format import E4M3, dequantize_e4m3, quantize_e4m3
from test_decode_kernels_emulated import assert_bf16_close, run
from test_deltanet_kernels_emulated import host
from test_rope_cache_emulated import bf16, f32, rb

ATTN_FACTOR = 0.9


def latent_inputs(rng, T: int, q_cols: int, R: int, Dr: int):
    y = bf16(2 * rng.standard_normal((T, q_cols + R + Dr)))
    kv_norm = bf16(1 + 0.2 * rng.standard_normal(R))
    inv_freq = (1.0 / (1e4 ** (np.arange(0, Dr, 2) / Dr))).astype(np.float32)
    positions = rng.integers(0, 500, T).astype(np.int32)
    slots = np.array([3 * t + 1 for t in range(T)], np.int32)
    slots[-1] = -1
    return y, kv_norm, inv_freq, positions, slots


@pytest.mark.parametrize("k_scale,q_norm", [(1.0, False), (0.004, True), (0.3, False)])
def test_latent_cache_writes_the_e4m3_of_the_bf16_row(k_scale, q_norm):
    rng = np.random.default_rng(int(k_scale * 1000))
    T, q_cols, R, Dr = 4, 48, 32, 8
    y, kv_norm, inv_freq, positions, slots = latent_inputs(rng, T, q_cols, R, Dr)
    qn = host(bf16(1 + 0.2 * rng.standard_normal(q_cols))) if q_norm else np.uint64(0)
    head = (host(y), np.int32(q_cols), np.int32(R), np.int32(Dr), host(kv_norm), qn, np.float32(1e-6),
            host(inv_freq), np.float32(ATTN_FACTOR), host(positions), host(slots))
    out = {}
    for fp8 in (False, True):
        cache = host(np.zeros((3 * T + 2, R + Dr), np.uint8 if fp8 else np.uint16))
        q = host(np.zeros((T, q_cols), np.uint16))
        run("mla_latent_cache", "mla_latent_cache" + ("_fp8" if fp8 else ""), (T,), 128,
            head + (cache, q) + ((np.float32(k_scale),) if fp8 else ()))
        out[fp8] = (np.array(q), np.array(cache))
    np.testing.assert_array_equal(out[True][0], out[False][0])
    np.testing.assert_array_equal(out[True][1], quantize_e4m3(f32(out[False][1]), k_scale).view(np.uint8))
    assert out[False][1][slots[:-1]].any() and not out[True][1][3 * T - 2].any()     # the padded token: no row
    if k_scale < 0.01:
        assert (np.abs(out[True][1].view(E4M3).astype(np.float32)) == 448).any()          # saturated, not NaN


def test_absorb_q_cache_fp8_writes_the_latent_cache_fp8_rows():
    """mla_absorb.cu's fused entry (q_lora_rank unset) stores the rows mla_latent_cache_fp8 stores."""
    rng = np.random.default_rng(5)
    T, H, N, V, R, Dr, k_scale = 3, 2, 24, 20, 32, 8, 0.05
    qk = N + Dr
    y, kv_norm, inv_freq, positions, slots = latent_inputs(rng, T, H * qk, R, Dr)
    kv_b = bf16(rng.standard_normal((H * (N + V), R)) / np.sqrt(N))
    common = (np.float32(1e-6), host(inv_freq), np.float32(ATTN_FACTOR), host(positions), host(slots))
    caches = []
    for fused in (False, True):
        cache, q = host(np.zeros((3 * T + 2, R + Dr), np.uint8)), host(np.zeros((T, H * qk), np.uint16))
        if fused:
            run("mla_absorb", "mla_absorb_q_cache_fp8", (-(-R // 64) + 1, H), 256,
                (host(y), host(kv_b), host(np.zeros((T, H, R), np.float32)), np.int32(T), np.int32(H), np.int32(N),
                 np.int32(V), np.int32(R), np.int32(qk), np.int32(Dr), host(kv_norm)) + common
                + (cache, q, np.float32(k_scale)))
        else:
            run("mla_latent_cache", "mla_latent_cache_fp8", (T,), 128,
                (host(y), np.int32(H * qk), np.int32(R), np.int32(Dr), host(kv_norm), np.uint64(0)) + common
                + (cache, q, np.float32(k_scale)))
        caches.append(np.array(cache))
    np.testing.assert_array_equal(caches[0], caches[1])
    assert caches[0].any()


def e4m3_bytes(rng, shape, spread: float) -> np.ndarray:
    """Random e4m3 cache bytes (finite values)."""
    return quantize_e4m3(spread * rng.standard_normal(shape), 1.0).view(np.uint8)


def test_expanded_prefill_reads_the_e4m3_cache_as_bf16():
    rng = np.random.default_rng(2)
    rows, H, N, V, R, Dr, k_scale = 5, 2, 16, 24, 32, 8, 0.02
    Dk = N + Dr
    cache8 = e4m3_bytes(rng, (12, R + Dr), 40)
    as_bf16 = bf16(dequantize_e4m3(cache8.view(E4M3), k_scale))          # bf16(e4m3 · k_scale)
    src = np.array([3, -1, 0, 11, 7], np.int32)
    kv = bf16(rng.standard_normal((rows, H * (N + V))))
    latent = {}
    for fp8, cache in ((True, cache8), (False, as_bf16)):
        entry, scale = ("_fp8", (np.float32(k_scale),)) if fp8 else ("", ())
        lat = host(np.zeros((rows, R), np.uint16))
        run("mla_prefill", "mla_gather_latent" + entry, (rows,), 64,
            (host(cache), host(src), lat, np.int32(R), np.int32(R + Dr)) + scale)
        k, v = host(np.zeros((rows, H * Dk), np.uint16)), host(np.zeros((rows, H * Dk), np.uint16))
        run("mla_prefill", "mla_expand_kv" + entry, (rows,), 128,
            (host(kv), host(cache), host(src), k, v, np.int32(H), np.int32(N), np.int32(V), np.int32(Dr),
             np.int32(R)) + scale)
        latent[fp8] = (np.array(lat), np.array(k), np.array(v))
    for name, a, b in zip(("latent", "k", "v"), latent[True], latent[False]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(latent[True][0][0], as_bf16[3, :R])
    np.testing.assert_array_equal(latent[True][1].reshape(rows, H, Dk)[3, 1, N:], as_bf16[11, R:])
    assert not latent[True][0][1].any()                                     # a padding row


def decode_reference(q_lat, q, cache, tables, token_seq, positions, inv_freq, nope, scale):
    """o_lat[t, h] = softmax_p(scale · (q_lat · c_p + rot(q_rope) · k_rope_p)) · c_p over p <= position (float32
    cache rows [slots, R + Dr]); the query's rope rotated as the kernel does (bf16 once)."""
    T, H, R = q_lat.shape
    Dr = cache.shape[1] - R
    out = np.zeros((T, H, R), np.float32)
    for t in range(T):
        pos = int(positions[t])
        p = np.arange(pos + 1)
        rows = cache[tables[token_seq[t], p // 16] * 16 + p % 16]
        ang = pos * inv_freq.astype(np.float64)
        c, s = (np.cos(ang) * ATTN_FACTOR).astype(np.float32), (np.sin(ang) * ATTN_FACTOR).astype(np.float32)
        qr = q[t, :, nope:].reshape(H, Dr // 2, 2)
        rot = np.stack([rb(qr[..., 0] * c - qr[..., 1] * s), rb(qr[..., 0] * s + qr[..., 1] * c)], -1).reshape(H, Dr)
        scores = scale * (q_lat[t] @ rows[:, :R].T + rot @ rows[:, R:].T)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[t] = (w / w.sum(-1, keepdims=True)) @ rows[:, :R]
    return out


@pytest.mark.parametrize("R,Dr,splits,group", [(32, 8, 1, 2), (32, 8, 3, 4), (64, 16, 2, 1)])
def test_decode_reads_the_e4m3_cache(R, Dr, splits, group):
    rng = np.random.default_rng(R + splits)
    T, H, nope, k_scale, scale = 3, 4, 16, 0.05, 0.2
    qk, max_blocks, slots = nope + Dr, 4, 6 * 16
    tables = np.array([[4, 1, 5, 0], [2, 3, 0, 0]], np.int32)
    token_seq, positions = np.array([0, 1, 0], np.int32), np.array([57, 20, 9], np.int32)
    q_lat = (rng.standard_normal((T, H, R)) / 4).astype(np.float32)
    q = bf16(rng.standard_normal((T, H, qk)))
    inv_freq = (1.0 / (1e4 ** (np.arange(0, Dr, 2) / Dr))).astype(np.float32)
    cache8 = e4m3_bytes(rng, (slots, R + Dr), 3 / k_scale)
    values = dequantize_e4m3(cache8.view(E4M3), k_scale)
    for fp8, cache, rows in ((True, cache8, values), (False, bf16(values), f32(bf16(values)))):
        parts = T * H * splits
        o = host(np.zeros((T, H, R), np.uint16))
        run("mla_decode", "mla_decode_split", (-(-H // group), splits, T), 256,
            (host(q_lat), host(q), np.int32(qk), np.int32(nope), host(inv_freq), np.float32(ATTN_FACTOR), host(cache),
             host(tables), np.int32(max_blocks), host(token_seq), host(positions),
             host(np.zeros(parts * R, np.float32)), host(np.zeros(parts, np.float32)),
             host(np.zeros(parts, np.float32)), o, host(np.zeros(T * H, np.int32)), np.int32(H), np.int32(group),
             np.float32(scale), np.float32(k_scale if fp8 else 1.0)),
            smem=mla_decode_smem(Dr, R, group, 1 if fp8 else 2), KV_RANK=R, ROPE_DIM=Dr, KV_FP8=int(fp8))
        want = decode_reference(q_lat, f32(q), rows, tables, token_seq, positions, inv_freq, nope, scale)
        assert_bf16_close(np.array(o), rb(want), f"fp8={fp8}")
