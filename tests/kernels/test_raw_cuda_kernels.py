"""Each raw CUDA kernel against a numpy reference (fresh random inputs, poisoned outputs)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f32(u: np.ndarray) -> np.ndarray:
    return np.asarray(u).view(ml_dtypes.bfloat16).astype(np.float32)


def rb(a: np.ndarray) -> np.ndarray:
    """Round to bf16 and back."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def dev(cp, a):
    return cp.asarray(np.ascontiguousarray(a))


def poison(cp, shape, dtype=np.uint16):
    return cp.full(shape, 0x7FC1 if dtype == np.uint16 else np.nan, dtype=dtype)


def k(name, fn):
    from openinfer_kernels.raw_cuda import kernel
    return kernel(name, fn)


def test_embedding_gather(cp):
    rng = np.random.default_rng(1)
    table = bits(rng.standard_normal((300, 64)))
    ids = rng.integers(0, 300, 37).astype(np.int32)
    out = poison(cp, (37, 64))
    k("embedding", "embedding_gather")((37,), (128,), (dev(cp, table), dev(cp, ids), out, np.int32(64)))
    np.testing.assert_array_equal(out.get(), table[ids])


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_residual(cp, with_residual):
    rng = np.random.default_rng(2)
    T, H, eps = 9, 2560, 1e-6
    x, res, w = bits(rng.standard_normal((T, H))), bits(rng.standard_normal((T, H))), bits(1 + 0.1 * rng.standard_normal(H))
    out, r_out = poison(cp, (T, H)), poison(cp, (T, H))
    dx = dev(cp, x)
    k("rms_norm", "rms_norm_residual")((T,), (256,), (dx, dev(cp, res) if with_residual else np.uint64(0),
                                                       dev(cp, w), out, r_out if with_residual else dx,
                                                       np.int32(H), np.float32(eps)))
    r = rb(f32(x) + f32(res)) if with_residual else f32(x)
    ref = rb(f32(w) * rb(r / np.sqrt(np.mean(r * r, -1, keepdims=True) + eps)))
    if with_residual:
        np.testing.assert_array_equal(r_out.get(), bits(r))
    got = f32(out.get())
    assert np.max(np.abs(got - ref) / (np.abs(ref) + 1e-2)) < 1e-2   # at most ~1 bf16 ulp


def rope_ref(x, pos, inv_freq, factor=1.0):
    half = x.shape[-1] // 2
    ang = pos[:, None].astype(np.float32) * inv_freq[None, :]
    c, s = (np.cos(ang) * factor)[:, None, :], (np.sin(ang) * factor)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


@pytest.mark.parametrize("D,qk_norm", [(128, True), (16, False), (64, True)])
def test_qk_norm_rope_cache(cp, D, qk_norm):
    rng = np.random.default_rng(3)
    T, Hq, Hkv, eps, slots = 11, 8, 2, 1e-6, 64
    qkv = bits(rng.standard_normal((T, (Hq + 2 * Hkv) * D)))
    qn, kn = bits(1 + 0.2 * rng.standard_normal(D)), bits(1 + 0.2 * rng.standard_normal(D))
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    pos = rng.integers(0, 4000, T).astype(np.int32)
    slot = rng.permutation(slots)[:T].astype(np.int32)
    slot[3] = -1                                              # padding: must not be written
    q_out = poison(cp, (T, Hq, D))
    kc, vc = poison(cp, (slots, Hkv, D)), poison(cp, (slots, Hkv, D))
    null = np.uint64(0)
    k("qk_norm_rope_cache", "qk_norm_rope_cache")(
        (T,), (128,), (dev(cp, qkv), dev(cp, qn) if qk_norm else null, dev(cp, kn) if qk_norm else null,
                       np.float32(eps), dev(cp, inv_freq), np.float32(1.0), dev(cp, pos), dev(cp, slot), q_out,
                       kc, vc, np.int32(Hq), np.int32(Hkv), np.int32(D)))
    x = f32(qkv)
    q = x[:, :Hq * D].reshape(T, Hq, D)
    kk = x[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
    v = x[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    if qk_norm:
        norm = lambda a, w: rb(f32(w) * rb(a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps)))  # noqa: E731
        q, kk = norm(q, qn), norm(kk, kn)
    q_ref, k_ref = rope_ref(q, pos, inv_freq), rope_ref(kk, pos, inv_freq)
    np.testing.assert_allclose(f32(q_out.get()), q_ref, atol=2e-2, rtol=1e-2)
    kc_h, vc_h = kc.get(), vc.get()
    for t in range(T):
        if slot[t] < 0:
            continue
        np.testing.assert_allclose(f32(kc_h[slot[t]]), k_ref[t], atol=2e-2, rtol=1e-2)
        np.testing.assert_array_equal(vc_h[slot[t]], bits(v[t]))
    untouched = np.setdiff1d(np.arange(slots), slot[slot >= 0])
    assert np.all(kc_h[untouched] == 0x7FC1) and np.all(vc_h[untouched] == 0x7FC1)


def test_silu_mul(cp):
    rng = np.random.default_rng(4)
    T, I = 7, 9728
    gu = bits(3 * rng.standard_normal((T, 2 * I)))
    out = poison(cp, (T, I))
    total = T * I // 8
    k("silu_mul", "silu_mul")((64,), (256,), (dev(cp, gu), out, np.int32(I), np.int64(total), np.int32(0)))
    g, u = f32(gu)[:, :I], f32(gu)[:, I:]
    ref = rb(rb(g / (1 + np.exp(-g))) * u)
    got = f32(out.get())
    assert np.max(np.abs(got - ref) / (np.abs(ref) + 1e-2)) < 1e-2


def test_add_bias(cp):
    rng = np.random.default_rng(5)
    y, b = bits(rng.standard_normal((5, 48))), bits(rng.standard_normal(48))
    dy = dev(cp, y)
    k("add_bias", "add_bias")((4,), (256,), (dy, dev(cp, b), np.int32(48), np.int64(5 * 48)))
    np.testing.assert_array_equal(dy.get(), bits(f32(y) + f32(b)))


def attention_ref(q, kc, vc, tables, token_seq, positions, scale, G):
    T, Hq, D = q.shape
    out = np.zeros((T, Hq * D), np.float32)
    for t in range(T):
        if positions[t] < 0:
            continue
        p = np.arange(positions[t] + 1)
        slots = tables[token_seq[t]][p // 16] * 16 + p % 16
        for h in range(Hq):
            s = (kc[slots, h // G] @ q[t, h]) * scale
            w = np.exp(s - s.max())
            out[t, h * D:(h + 1) * D] = (w / w.sum()) @ vc[slots, h // G]
    return out


def attention_case(rng, D: int, Hkv: int):
    """Three sequences (a 700-token context decoding, a 40-token prefill chunk on a 20-token prefix,
    a 1-token context) in shuffled blocks of a 128-block cache, plus one padded token:
    (k_cache, v_cache, block_tables [3, 48], token_seq, positions)."""
    nblocks = 128
    kc, vc = bits(rng.standard_normal((nblocks * 16, Hkv, D))), bits(rng.standard_normal((nblocks * 16, Hkv, D)))
    perm = rng.permutation(nblocks).astype(np.int32)
    tables = np.zeros((3, 48), np.int32)
    tables[0, :44], tables[1, :4], tables[2, :1] = perm[:44], perm[44:48], perm[48:49]
    token_seq = np.array([0] + [1] * 40 + [2, 0], np.int32)
    positions = np.array([699] + list(range(20, 60)) + [0, -1], np.int32)
    return kc, vc, tables, token_seq, positions


@pytest.mark.parametrize("D,Hq,Hkv,splits", [(128, 32, 8, 1), (128, 32, 8, 7), (16, 8, 2, 3), (64, 4, 4, 16)])
def test_paged_attention(cp, D, Hq, Hkv, splits):
    rng = np.random.default_rng(6)
    kc, vc, tables, token_seq, positions = attention_case(rng, D, Hkv)
    T = len(positions)
    q = bits(rng.standard_normal((T, Hq, D)))
    S = splits
    part_out = cp.full((T * Hq * S * D,), np.nan, np.float32)
    part_max, part_sum = cp.full((T * Hq * S,), np.nan, np.float32), cp.full((T * Hq * S,), np.nan, np.float32)
    out = poison(cp, (T, Hq * D))
    scale = D ** -0.5
    dkc, dvc = dev(cp, kc), dev(cp, vc)
    k("paged_attention", "paged_attention_split")(
        (S, Hkv, T), (128,), (dev(cp, q), dkc, dvc, dev(cp, tables), np.int32(48), dev(cp, token_seq),
                              dev(cp, positions), part_out, part_max, part_sum, np.int32(Hq), np.int32(Hkv),
                              np.int32(D), np.float32(scale)))
    k("paged_attention", "attention_merge")((T * Hq,), (128,), (part_out, part_max, part_sum, out, np.int32(S), np.int32(D)))
    ref = attention_ref(f32(q), f32(kc), f32(vc), tables, token_seq, positions, scale, Hq // Hkv)
    got = f32(out.get())
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, atol=1.5e-2, rtol=1e-2)


def test_argmax_logprob_topk(cp):
    rng = np.random.default_rng(7)
    S, V = 5, 151936
    x = (3 * rng.standard_normal((S, V))).astype(np.float32)
    x[2, 100] = x[2, 7] = x[2].max() + 1                 # a tie: the lower id wins
    dx = dev(cp, x)
    ids, lp, lse = cp.full(S, -1, np.int32), cp.full(S, np.nan, np.float32), cp.full(S, np.nan, np.float32)
    k("argmax_logprobs", "argmax_logprob")((S,), (1024,), (dx, np.int32(V), np.uint64(0), ids, lp, lse))
    ref_lse = np.log(np.exp(x.astype(np.float64) - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    np.testing.assert_array_equal(ids.get(), np.argmax(x, 1))
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-5)
    np.testing.assert_allclose(lp.get(), x.max(1) - ref_lse, atol=1e-4)
    kk = 20
    tid, tlp = cp.full((S, kk), -1, np.int32), cp.full((S, kk), np.nan, np.float32)
    k("argmax_logprobs", "topk_logprobs")((S,), (1024,), (dx, np.int32(V), np.int32(kk), lse, tid, tlp))
    ref_ids = np.stack([np.lexsort((np.arange(V), -row))[:kk] for row in x])
    np.testing.assert_array_equal(tid.get(), ref_ids)
    np.testing.assert_allclose(tlp.get(), np.take_along_axis(x, ref_ids, 1) - ref_lse[:, None], atol=1e-4)
