"""NumPy models of the index math of the decode kernels (no GPU): the GEMV's mapping of each lane's
16-byte loads onto mma.m16n8k16 fragment slots (as PTX defines the fragment layouts) reproduces x·wᵀ,
and the decode attention's (split, warp, pass, lane-group) walk covers every key of a context once."""
from __future__ import annotations

import numpy as np
import pytest

WARPS, UNROLL, GEMV_WARPS, GEMV_UNROLL = 4, 4, 8, 4     # paged_decode.cu / gemv.cu constants


def mma_16816(c, a_regs, b_regs):
    """One warp's mma.m16n8k16 (row.col) from per-lane registers, each register a pair of values
    (low, high): rebuild A [16, 16] and B [16, 8] from PTX's fragment layout and accumulate C [16, 8]
    returned as per-lane (c0..c3)."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = a_regs[lane]
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[0], a[1]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[2], a[3]
        b = b_regs[lane]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b[0], b[1]
    assert not np.isnan(A).any() and not np.isnan(B).any()
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]


def gemv_model(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """gemv.cu's per-CTA work, lane by lane, with exact (float64) products."""
    M, K = x.shape
    N = w.shape[0]
    NT = -(-M // 8)
    y = np.full((M, N), np.nan)
    steps = -(-K // 32)
    per_warp = -(-steps // GEMV_WARPS)
    for row0 in range(0, N, 16):
        red = np.zeros((GEMV_WARPS, NT, 32, 4))
        for warp in range(GEMV_WARPS):
            s_begin, s_end = warp * per_warp, min(steps, warp * per_warp + per_warp)
            c = np.zeros((NT, 32, 4))
            for s in range(s_begin, s_end):
                def load(mat, r, k, ok):
                    v = mat[r, k:k + 8] if ok and k < K else np.zeros(8)
                    return [v[0:2], v[2:4], v[4:6], v[6:8]]          # .x .y .z .w as (low, high) pairs
                lo, hi, bx = [], [], [[] for _ in range(NT)]
                for lane in range(32):
                    g, tq = lane >> 2, lane & 3
                    k = s * 32 + tq * 8
                    lo.append(load(w, row0 + g, k, row0 + g < N))
                    hi.append(load(w, row0 + g + 8, k, row0 + g + 8 < N))
                    for n in range(NT):
                        bx[n].append(load(x, n * 8 + g, k, n * 8 + g < M))
                for n in range(NT):
                    mma_16816(c[n], [[lo[i][0], hi[i][0], lo[i][1], hi[i][1]] for i in range(32)],
                              [[bx[n][i][0], bx[n][i][1]] for i in range(32)])
                    mma_16816(c[n], [[lo[i][2], hi[i][2], lo[i][3], hi[i][3]] for i in range(32)],
                              [[bx[n][i][2], bx[n][i][3]] for i in range(32)])
            red[warp] = c
        for i in range(NT * 4 * 32):              # the kernel's store loop
            slot, ln = divmod(i, 32)
            n, j = divmod(slot, 4)
            m, row = n * 8 + (ln & 3) * 2 + (j & 1), row0 + (ln >> 2) + 8 * (j >> 1)
            if m < M and row < N:
                y[m, row] = red[:, n, ln, j].sum()
    return y


@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (3, 40, 264), (8, 16, 64), (13, 24, 96), (32, 17, 40)])
def test_gemv_fragment_mapping(M, N, K):
    rng = np.random.default_rng(M * 1000 + N)
    x, w = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    np.testing.assert_allclose(gemv_model(x, w), x @ w.T, rtol=1e-10, atol=1e-10)


def key_lanes(D: int) -> int:
    dv = D // 8
    return dv if dv <= 16 and dv & (dv - 1) == 0 else 16


@pytest.mark.parametrize("D", [16, 32, 64, 96, 128, 256])
@pytest.mark.parametrize("ctx,S", [(1, 1), (129, 1), (129, 33), (700, 7), (16, 64), (4097, 3), (0, 4)])
def test_decode_attention_walk_covers_each_key_once(D, ctx, S):
    """Every key in [0, ctx) is read by exactly one (split, warp, iteration, pass, lane group); the
    D/8 16-byte slices of a key row are read by exactly one lane of its group."""
    kl = key_lanes(D)
    chunks = -(-(D // 8) // kl)
    kpp = 32 // kl
    kpi = kpp * UNROLL
    per_split = (-(-ctx // S) + 15) // 16 * 16 if ctx else 0
    seen = np.zeros(ctx, int)
    for split in range(S):
        start, end = split * per_split, min(ctx, split * per_split + per_split)
        for warp in range(WARPS):
            for base in range(start + warp * kpi, end, WARPS * kpi):
                for u in range(UNROLL):
                    for key in range(kpp):
                        p = base + u * kpp + key
                        if p < end:
                            seen[p] += 1
    np.testing.assert_array_equal(seen, 1)
    slices = sorted((c * kl + sub) for c in range(chunks) for sub in range(kl) if (c * kl + sub) * 8 < D)
    assert slices == list(range(D // 8))


def decode_attention_model(q, k, v, ctx: int, S: int, D: int):
    """paged_decode.cu's arithmetic for one (token, KV head): log2-domain scores, per-warp online
    softmax over (iteration, pass) with a warp-uniform running max, the warps merged in the CTA,
    then attention_merge over the splits (natural-log maxima)."""
    kl = key_lanes(D)
    kpp, G = 32 // kl, q.shape[0]
    kpi = kpp * UNROLL
    qs = q * D ** -0.5 * np.log2(np.e)
    per_split = (-(-ctx // S) + 15) // 16 * 16 if ctx else 0
    parts = []
    for split in range(S):
        start, end = split * per_split, min(ctx, split * per_split + per_split)
        warps = []
        for warp in range(WARPS):
            m, lsum, acc = np.full(G, -np.inf), np.zeros(G), np.zeros((G, D))
            for base in range(start + warp * kpi, end, WARPS * kpi):
                keys = [p for p in range(base, base + kpi) if p < end]
                s = qs @ k[keys].T                                  # [G, keys]
                m_new = np.maximum(m, s.max(1))
                alpha = np.exp2(m - m_new)
                p = np.exp2(s - m_new[:, None])
                lsum = lsum * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p @ v[keys]
                m = m_new
            warps.append((m, lsum, acc))
        mx = np.max([np.where(w[1] > 0, w[0], -np.inf) for w in warps], 0)
        o, tot = np.zeros((G, D)), np.zeros(G)
        for m, lsum, acc in warps:
            f = np.where(lsum > 0, np.exp2(np.where(lsum > 0, m, 0) - np.where(np.isfinite(mx), mx, 0)), 0)
            o += acc * f[:, None]
            tot += lsum * f
        parts.append((mx * np.log(2), tot, o))
    if S == 1:
        return np.where(parts[0][1][:, None] > 0, parts[0][2] / np.maximum(parts[0][1], 1e-300)[:, None], 0)
    live = [pt for pt in parts if np.all(pt[1] > 0)]
    if not live:
        return np.zeros((G, D))
    m = np.max([pt[0] for pt in live], 0)
    num = sum(pt[2] * np.exp(pt[0] - m)[:, None] for pt in live)
    den = sum(pt[1] * np.exp(pt[0] - m) for pt in live)
    return num / den[:, None]


@pytest.mark.parametrize("D,G,ctx,S", [(128, 4, 700, 1), (128, 4, 129, 33), (16, 4, 60, 3), (64, 1, 1, 16),
                                       (96, 2, 257, 5), (128, 4, 0, 4)])
def test_decode_attention_arithmetic(D, G, ctx, S):
    rng = np.random.default_rng(ctx + S)
    q, k, v = rng.standard_normal((G, D)), rng.standard_normal((max(ctx, 1), D)), rng.standard_normal((max(ctx, 1), D))
    got = decode_attention_model(q, k, v, ctx, S, D)
    if ctx == 0:
        np.testing.assert_array_equal(got, 0)
        return
    s = q @ k[:ctx].T * D ** -0.5
    w = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(got, (w / w.sum(1, keepdims=True)) @ v[:ctx], rtol=1e-9, atol=1e-12)
