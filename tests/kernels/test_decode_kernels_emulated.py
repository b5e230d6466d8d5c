"""Decode-step kernels on the host, without a GPU (tests/cuda_emulation.h, as test_deltanet_kernels_emulated),
each against numpy with the kernels' roundings and launched with the grids their GPU ops use: LoRA's
rms_norm.cu splitk_rms_norm_residual_lora (the o / down delta in the split-K reduction, compiled per rank),
lora_expand.cu's epilogues in both tile sizes (TT 8, and 4 for small steps) from the extended product or the
shrink's partials, and paged_decode.cu's rope_paged_decode_attention_lora (bit for bit against compaction +
the plain fused entry) and the plain fused entry (bit for bit against qk_norm_rope_cache.cu + the unfused one); MLA's mla_absorb.cu projections; the MoE decode experts of moe_gemv.cu.
What the emulation cannot see (speed, coalescing, occupancy) is for the GPU tests (test_gpu_lora.py,
test_gpu_moe_mla_kernels.py)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.executor.gpu_lora_ops import EXPAND_COPY, EXPAND_SWIGLU, group_by_slot
from engine.executor.gpu_ops import splitk_norm_threads
from openinfer_kernels.raw_cuda.launch import pack_argument
from test_deltanet_kernels_emulated import emulated, host
from test_rope_cache_emulated import bf16, f32, rb


def run(name: str, entry: str, grid, threads: int, args, smem: int = 0, **defines) -> None:
    values = [pack_argument(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    g = tuple(grid) + (1,) * (3 - len(grid))
    getattr(emulated(name, tuple(sorted(defines.items()))), f"emu_{entry}")(
        *(ctypes.c_uint(v) for v in g), ctypes.c_uint(threads), ctypes.c_size_t(smem), params)


def assert_bf16_close(got_bits, want, what) -> None:
    """Equal up to one bf16 rounding step (the kernel's float32 sums may round the other way)."""
    got = f32(got_bits)
    np.testing.assert_allclose(got, want, rtol=1.6e-2, atol=1e-3, err_msg=what)
    assert np.mean(got == want) > 0.9, what


@pytest.mark.parametrize("hidden,rank,splits,slots,most", [(64, 16, 3, [0, -1, 2, 1], 1024), (200, 8, 1, [1, 1, -1], 1024),
                                                           (256, 32, 6, [2, 1], 1024), (96, 64, 5, [2, 0], 1024),
                                                           (8192, 8, 2, [1, -1], 1024), (2560, 16, 3, [2, -1], 512)])
def test_splitk_norm_with_the_lora_delta(hidden, rank, splits, slots, most):
    """r = bf16(sum of the split-K partials (split order) + h · B[slot]ᵀ + residual), h the row's slot's
    shrink columns summed over the splits; out = bf16(w · bf16(r · rstd)); rows without a slot: no delta.
    Ranks to 32 with warps to spare compute the delta beside the sum (Qwen3-4B's 2,560 columns on 512 threads:
    6 helper warps); rank 64, and hidden 8192 (a thread per vector, none to spare), one after the other."""
    rng = np.random.default_rng(hidden + rank)
    T, S = len(slots), 3
    ld = hidden + S * rank
    partial = rng.standard_normal((splits, T, ld)).astype(np.float32)
    residual, w = bf16(rng.standard_normal((T, hidden))), bf16(1 + 0.1 * rng.standard_normal(hidden))
    B = bf16(0.3 * rng.standard_normal((S, hidden, rank)))
    token_slots = np.array(slots, np.int32)
    out, resid_out = host(np.zeros((T, hidden), np.uint16)), host(np.zeros((T, hidden), np.uint16))
    threads = min(most, max(splitk_norm_threads(hidden), -(-hidden // 32) * 32))
    run("rms_norm", "splitk_rms_norm_residual_lora", (T,), threads,
        (host(partial), np.int32(splits), np.int64(T * ld), np.int32(ld), host(residual), host(w), out, resid_out,
         np.int32(hidden), np.float32(1e-6), host(token_slots), host(B), np.int32(rank)), LORA_R=rank)
    acc = np.zeros((T, hidden), np.float32)
    for s in range(splits):
        acc += partial[s, :, :hidden]
    for t, slot in enumerate(slots):
        if slot >= 0:
            h = np.zeros(rank, np.float32)
            for s in range(splits):
                h += partial[s, t, hidden + slot * rank:hidden + (slot + 1) * rank]
            acc[t] += f32(B[slot]) @ h
    r = rb(acc + f32(residual))
    rstd = 1 / np.sqrt(np.mean(r * r, -1, keepdims=True) + np.float32(1e-6))
    assert_bf16_close(resid_out, r, "resid_out")
    assert_bf16_close(out, rb(f32(w) * rb(r * rstd)), "normed")


def silu_times(g, u):
    return rb(rb(g / (1 + np.exp(-g))) * u)


@pytest.mark.parametrize("tile", [8, 4])
@pytest.mark.parametrize("mode,slices,interleaved", [(EXPAND_COPY, (48, 16, 16), 0), (EXPAND_SWIGLU, (40, 40), 1),
                                                     (EXPAND_SWIGLU, (24, 24), 0)])
def test_expand_from_the_extended_product(tile, mode, slices, interleaved):
    """lora_expand.cu reading the shrink from the extended product's row [T, N + slots · NR] (bf16):
    mode 3, the first N columns with each row's delta (bf16(y + h · B[slot, c])) compacted; mode 2, SiLU·up
    of the gate / up columns with their deltas added first (interleaved: 8 gate rows, then their 8 up rows);
    rows without an adapter copied / plain SiLU·up; every token tile of each slot's group."""
    rng = np.random.default_rng(tile + mode)
    R, S = 8, 3
    N, NR = sum(slices), len(slices) * R
    token_slots = np.array([0, 2, -1, 0, 1, 0, 0, 0, 0, 0, -1, 2], np.int32)
    T = len(token_slots)
    wide = bf16(rng.standard_normal((T, N + S * NR)))
    B = bf16(0.5 * rng.standard_normal((S, N, R)))
    order, starts = group_by_slot(token_slots, S)
    cols = N // 2 if mode == EXPAND_SWIGLU else N
    act = host(np.zeros((T, cols), np.uint16))
    ends = list(np.cumsum(slices)[:-1]) + [N] * 2
    run("lora_expand", "lora_expand", (-(-cols // 256), -(-T // tile), S + 1), 256,
        (host(wide), np.int32(1), np.int64(0), np.int32(N + S * NR), np.int32(N), np.int32(NR), host(B),
         host(order.astype(np.int32)), host(starts.astype(np.int32)), host(wide), np.int32(N + S * NR), act,
         np.int32(N), np.int32(R), np.int32(NR), np.int32(1), np.int32(ends[0]), np.int32(ends[1]),
         np.int32(interleaved), np.int32(mode)), smem=8 * NR * 4, TT=tile)
    y = f32(wide)
    delta = np.zeros((T, N), np.float32)
    c = np.arange(N)
    slice_of = (c // 8) % 2 if interleaved else (c >= ends[0]).astype(int) + (c >= ends[1])
    for t, s in enumerate(token_slots):
        if s >= 0:
            h = y[t, N + s * NR:N + (s + 1) * NR].reshape(len(slices), R)
            delta[t] = np.einsum("cr,cr->c", f32(B[s]), h[slice_of])
    if mode == EXPAND_COPY:
        assert_bf16_close(act, rb(y[:, :N] + delta), "compacted")
        return
    if interleaved:
        i = np.arange(cols)
        g_col, u_col = (i // 8) * 16 + i % 8, (i // 8) * 16 + i % 8 + 8
    else:
        g_col, u_col = np.arange(cols), np.arange(cols) + cols
    has = (token_slots >= 0)[:, None]
    g = np.where(has, rb(y[:, g_col] + delta[:, g_col]), y[:, g_col])
    u = np.where(has, rb(y[:, u_col] + delta[:, u_col]), y[:, u_col])
    assert_bf16_close(act, silu_times(g, u), "silu")


@pytest.mark.parametrize("T,H,N,V,R", [(1, 3, 24, 20, 32), (3, 2, 16, 24, 128), (8, 4, 128, 128, 512)])
def test_mla_absorb_projections(T, H, N, V, R):
    """mla_absorb.cu: q_lat[t, h] = W_UK_hᵀ q_nope[t, h] (float32) from q rows [T, H·qk] and kv_b_proj
    [H·(N + V), R]; o[t, h] = bf16(W_UV_h o_lat[t, h]) (grids as gpu_mla_ops._mla_absorbed)."""
    rng = np.random.default_rng(T + R)
    qk = N + 8
    q, kv_b = bf16(rng.standard_normal((T, H * qk))), bf16(rng.standard_normal((H * (N + V), R)) / np.sqrt(N))
    o_lat = bf16(rng.standard_normal((T, H * R)))
    q_lat, o = host(np.zeros((T, H, R), np.float32)), host(np.zeros((T, H * V), np.uint16))
    run("mla_absorb", "mla_absorb_q", (-(-R // 64), H), 256,
        (host(q), host(kv_b), q_lat, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R), np.int32(qk)))
    run("mla_absorb", "mla_absorb_o", (-(-V // 8), H), 256,
        (host(o_lat), host(kv_b), o, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R)))
    w = f32(kv_b).reshape(H, N + V, R)
    qn = f32(q).reshape(T, H, qk)[:, :, :N]
    np.testing.assert_allclose(q_lat, np.einsum("thn,hnr->thr", qn, w[:, :N]), rtol=1e-5, atol=1e-4)
    want = np.einsum("thr,hvr->thv", f32(o_lat).reshape(T, H, R), w[:, N:]).reshape(T, H * V)
    assert_bf16_close(o, rb(want), "o")


def decode_attention_args(rng, T: int, Hq: int, Hkv: int, D: int, splits: int):
    """A decode step's cache and tables for paged_decode.cu: token t of sequence t at context 5 + 16·t,
    blocks shuffled, the new tokens' slots zeroed. Returns (tail arguments after slot_mapping, the slot
    mapping, k cache, v cache, out)."""
    contexts = [5 + 16 * t for t in range(T)]
    blocks = [-(-c // 16) for c in contexts]
    perm = rng.permutation(sum(blocks) + 2).astype(np.int32)
    tables, at = np.zeros((T, max(blocks)), np.int32), 0
    for i, n in enumerate(blocks):
        tables[i, :n], at = perm[at:at + n], at + n
    positions = np.array([c - 1 for c in contexts], np.int32)
    slots = np.array([tables[i, p // 16] * 16 + p % 16 for i, p in enumerate(positions)], np.int32)
    kc, vc = (host(bf16(rng.standard_normal(((len(perm)) * 16, Hkv, D)))) for _ in range(2))
    out = host(np.zeros((T, Hq * D), np.uint16))
    tail = (kc, vc, host(tables), np.int32(tables.shape[1]), host(np.arange(T, dtype=np.int32)), host(positions),
            host(np.zeros(T * Hq * splits * D, np.float32)), host(np.zeros(T * Hq * splits, np.float32)),
            host(np.zeros(T * Hq * splits, np.float32)), out, host(np.zeros(T * Hq, np.int32)), np.int32(Hkv),
            np.float32(D ** -0.5))
    return tail, host(slots), kc, vc, out


@pytest.mark.parametrize("group,heads,splits", [(2, 2, 1), (2, 1, 3), (4, 2, 2)])
def test_rope_decode_attention_adds_the_lora_delta(group, heads, splits):
    """paged_decode.cu's rope_paged_decode_attention_lora on the extended q/k/v product's rows (the delta of
    each row's slot added in its prologue; a row without one read as it is) gives the bits of the plain
    fused entry on those rows compacted with their deltas by lora_expand.cu (mode 3): the attention output
    and the K / V written to the cache."""
    rng = np.random.default_rng(group * 10 + splits)
    D, Hkv, R, S = 32, 2, 8, 3
    Hq = group * Hkv
    N, NR = (Hq + 2 * Hkv) * D, 3 * R
    token_slots = np.array([0, -1, 2, 0], np.int32)
    T = len(token_slots)
    wide = bf16(rng.standard_normal((T, N + S * NR)))
    B = bf16(0.5 * rng.standard_normal((S, N, R)))
    q_norm, k_norm = bf16(1 + 0.2 * rng.standard_normal(D)), bf16(1 + 0.2 * rng.standard_normal(D))
    inv_freq = (1.0 / (1e4 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    order, starts = group_by_slot(token_slots, S)
    compact = host(np.zeros((T, N), np.uint16))
    run("lora_expand", "lora_expand", (-(-N // 256), -(-T // 4), S + 1), 256,
        (host(wide), np.int32(1), np.int64(0), np.int32(N + S * NR), np.int32(N), np.int32(NR), host(B),
         host(order.astype(np.int32)), host(starts.astype(np.int32)), host(wide), np.int32(N + S * NR), compact,
         np.int32(N), np.int32(R), np.int32(NR), np.int32(1), np.int32(Hq * D), np.int32((Hq + Hkv) * D),
         np.int32(0), np.int32(EXPAND_COPY)), smem=8 * NR * 4, TT=4)
    build = dict(GQA=group, HEAD_DIM=D, LORA_R=R, **({"HEADS": heads} if heads != group else {}))
    grid = (T, splits, Hkv * (group // heads))
    prologue = (host(q_norm), host(k_norm), np.float32(1e-6), host(inv_freq), np.float32(1.0))
    results = []
    for lora in (False, True):
        tail, slot_mapping, kc, vc, out = decode_attention_args(np.random.default_rng(7), T, Hq, Hkv, D, splits)
        if lora:
            run("paged_decode", "rope_paged_decode_attention_lora", grid, 128,
                (host(wide), np.int32(N + S * NR), host(token_slots), host(B)) + prologue + (slot_mapping,) + tail,
                **build)
        else:
            run("paged_decode", "rope_paged_decode_attention", grid, 128,
                (compact,) + prologue + (slot_mapping,) + tail, **build)
        results.append((np.array(out), np.array(kc), np.array(vc)))
    for name, a, b in zip(("out", "k cache", "v cache"), *results):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert np.any(results[0][0] != 0)


def paged_attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray,
                              positions: np.ndarray) -> np.ndarray:
    """float32 attention of query row t (q [T, Hq, D]) over its sequence's keys 0..positions[t] (k, v [slots, Hkv, D]
    through the 16-token block tables [T, width]), query head h reading KV head h // (Hq / Hkv)."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    want = np.zeros((T, Hq, D), np.float32)
    for t in range(T):
        p = np.arange(positions[t] + 1)
        slots = tables[t, p // 16] * 16 + p % 16
        for h in range(Hq):
            sc = k[slots, h // group] @ q[t, h] * np.float32(D ** -0.5)
            w = np.exp(sc - sc.max())
            want[t, h] = (w / w.sum()) @ v[slots, h // group]
    return want


@pytest.mark.parametrize("D,group,heads,splits", [(128, 4, 4, 1), (128, 4, 2, 3), (128, 8, 8, 2), (64, 8, 8, 1),
                                                   (256, 4, 4, 2), (32, 8, 8, 1), (64, 6, 6, 2), (128, 1, 1, 2)])
def test_decode_attention_matches_numpy(D, group, heads, splits):
    """paged_decode.cu's plain entry against float32 attention over each sequence's paged keys: the query heads
    of a key summed by halving exchanges (power-of-two groups up to the key's lanes) or a butterfly a head
    (GQA 6, and 8 heads over D 32's 4 lanes), in head groups and over splits merged by the last CTA."""
    rng = np.random.default_rng(D * group + splits)
    Hkv, T = 2, 5
    Hq = group * Hkv
    tail, _, kc, vc, out = decode_attention_args(np.random.default_rng(3), T, Hq, Hkv, D, splits)
    q = bf16(2 * rng.standard_normal((T, Hq, D)))
    build = dict(GQA=group, HEAD_DIM=D, LORA_R=8, **({"HEADS": heads} if heads != group else {}))
    run("paged_decode", "paged_decode_attention", (T, splits, Hkv * (group // heads)), 128, (host(q),) + tail, **build)
    want = paged_attention_reference(f32(q), f32(np.asarray(kc)), f32(np.asarray(vc)), np.asarray(tail[2]),
                                     np.asarray(tail[5]))
    assert_bf16_close(np.asarray(out).reshape(T, Hq, D), rb(want), f"D {D}, GQA {group}, {heads} heads, {splits} splits")


@pytest.mark.parametrize("D,group,heads,splits,qk_norm", [(128, 4, 4, 1, True), (128, 4, 2, 3, True),
                                                      (64, 2, 2, 2, False), (256, 2, 1, 1, True), (48, 2, 2, 2, True)])
def test_rope_decode_attention_equals_composed(D, group, heads, splits, qk_norm):
    """paged_decode.cu's fused entry (q/k norm + rope + KV write + attention in one launch) gives the bits of
    qk_norm_rope_cache.cu then the plain entry: the attention output and the K / V written to the cache, in
    16-byte pieces (D 64 / 128 / 256, lane groups on several heads of a warp, the key among them) and a warp
    a head (D 48). A decode row computed in a mixed step and alone must match (GPU: test_raw_cuda_rope_attention)."""
    rng = np.random.default_rng(D + group * 7 + splits)
    Hkv, T = 2, 3
    Hq = group * Hkv
    qkv = bf16(rng.standard_normal((T, (Hq + 2 * Hkv) * D)))
    q_norm, k_norm = ((bf16(1 + 0.2 * rng.standard_normal(D)) for _ in range(2)) if qk_norm
                      else (np.uint64(0), np.uint64(0)))
    norms = (host(q_norm), host(k_norm)) if qk_norm else (q_norm, k_norm)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    # LORA_R: the emulation wraps every entry of the file, the LoRA one too
    build = dict(GQA=group, HEAD_DIM=D, LORA_R=8, **({"HEADS": heads} if heads != group else {}))
    grid = (T, splits, Hkv * (group // heads))
    results = []
    for fused in (True, False):
        tail, slot_mapping, kc, vc, out = decode_attention_args(np.random.default_rng(11), T, Hq, Hkv, D, splits)
        positions = tail[5]
        if fused:
            run("paged_decode", "rope_paged_decode_attention", grid, 128,
                (host(qkv),) + norms + (np.float32(1e-6), host(inv_freq), np.float32(1.0), slot_mapping) + tail,
                **build)
        else:
            q = host(np.zeros((T, Hq, D), np.uint16))
            run("qk_norm_rope_cache", "qk_norm_rope_cache", (T, 1), 256,
                (host(qkv),) + norms + (np.float32(1e-6), host(inv_freq), np.float32(1.0), positions, slot_mapping,
                                        q, kc, vc, np.int32(Hq), np.int32(Hkv), np.int32(D)))
            run("paged_decode", "paged_decode_attention", grid, 128, (q,) + tail, **build)
        results.append((np.array(out), np.array(kc), np.array(vc)))
    for name, a, b in zip(("out", "k cache", "v cache"), *results):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert np.any(results[0][0] != 0)


@pytest.mark.parametrize("tile", [8, 4])
@pytest.mark.parametrize("mode", [0, 1])
def test_expand_from_shrink_partials(tile, mode):
    """lora_expand.cu after lora_shrink.cu (larger steps, or small ones off the extended product): the
    shrink's float32 split-K partials [C, T, NR] summed (atomically, in shared memory) and the delta added
    to the projection's bf16 output in place (mode 0) or to a float32 split-K partial (mode 1)."""
    rng = np.random.default_rng(tile * 3 + mode)
    R, S, C, slices = 8, 3, 3, (24, 16, 16)
    N, NR = sum(slices), len(slices) * R
    token_slots = np.array([1, -1, 0, 1, 1, 2, 1, 1, 1, 1, 1], np.int32)
    T = len(token_slots)
    part = rng.standard_normal((C, T, NR)).astype(np.float32)
    B = bf16(0.5 * rng.standard_normal((S, N, R)))
    y0 = bf16(rng.standard_normal((T, N))) if mode == 0 else rng.standard_normal((T, N)).astype(np.float32)
    y = host(y0.copy())
    order, starts = group_by_slot(token_slots, S)
    ends = list(np.cumsum(slices)[:-1]) + [N] * 2
    run("lora_expand", "lora_expand", (-(-N // 256), -(-T // tile), S), 256,
        (host(part), np.int32(0), np.int64(T * NR), np.int32(NR), np.int32(0), np.int32(0), host(B),
         host(order.astype(np.int32)), host(starts.astype(np.int32)), y, np.int32(N), np.uint64(0), np.int32(N),
         np.int32(R), np.int32(NR), np.int32(C), np.int32(ends[0]), np.int32(ends[1]), np.int32(0),
         np.int32(mode)), smem=8 * NR * 4, TT=tile)
    h = part.sum(0)
    c = np.arange(N)
    slice_of = (c >= ends[0]).astype(int) + (c >= ends[1])
    delta = np.zeros((T, N), np.float32)
    for t, s in enumerate(token_slots):
        if s >= 0:
            delta[t] = np.einsum("cr,cr->c", f32(B[s]), h[t].reshape(len(slices), R)[slice_of])
    if mode == 0:
        assert_bf16_close(y, rb(f32(y0) + delta), "in place")
    else:
        np.testing.assert_allclose(np.array(y), y0 + delta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,top_k,interleaved,cols,unroll", [(1, 6, 1, 8, 2), (3, 2, 0, 8, 2), (1, 6, 1, 4, 4),
                                                              (3, 2, 0, 2, 1)])
def test_moe_decode_experts(T, top_k, interleaved, cols, unroll):
    """moe_gemv.cu's ungrouped decode experts: moe_gemv_silu (act = SiLU(bf16 gate) · bf16 up of each
    (token, slot)'s expert; gate_up rows interleaved in blocks of 8 or [gate | up]) and moe_gemv_combine
    (out = bf16(residual + sum_k weight · bf16(act · down)), in slot order; a slot of id -1 dropped), in
    every compile variant (COMBINE_COLS columns a CTA, MOE_UNROLL): the same bits."""
    rng = np.random.default_rng(T * 10 + top_k)
    E, H, I = 5, 72, 40
    x = bf16(rng.standard_normal((T, H)))
    gate_up = bf16(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H))
    down = bf16(rng.standard_normal((E, H, I)) / np.sqrt(I))
    ids = rng.integers(0, E, (T, top_k)).astype(np.int32)
    ids[0, -1] = -1
    weights = rng.uniform(0.1, 1, (T, top_k)).astype(np.float32)
    residual = bf16(rng.standard_normal((T, H)))

    def experts(cols: int, unroll: int):
        act, out = host(np.zeros((T * top_k, I), np.uint16)), host(np.zeros((T, H), np.uint16))
        variant = dict(COMBINE_COLS=cols, MOE_UNROLL=unroll)
        run("moe_gemv", "moe_gemv_silu", (-(-I // 16), T * top_k), 128,
            (host(x), host(gate_up), host(ids), act, np.int32(I), np.int32(H), np.int32(top_k),
             np.int32(interleaved)), **variant)
        run("moe_gemv", "moe_gemv_combine", (-(-H // cols), T), 32 * min(top_k, 8),
            (act, host(down), host(ids), host(weights), host(residual), out, np.int32(H), np.int32(I),
             np.int32(top_k)), **variant)
        return np.array(act), np.array(out)

    act, out = experts(cols, unroll)
    if (cols, unroll) != (8, 2):
        for got, want in zip((act, out), experts(8, 2)):
            np.testing.assert_array_equal(got, want)
    w = f32(gate_up)
    if interleaved:
        c = np.arange(I)
        g_rows, u_rows = (c // 8) * 16 + c % 8, (c // 8) * 16 + c % 8 + 8
    else:
        g_rows, u_rows = np.arange(I), np.arange(I) + I
    want_act = np.zeros((T * top_k, I), np.float32)
    for s in range(T * top_k):
        e = ids.flat[s]
        if e >= 0:
            xs = f32(x)[s // top_k]
            want_act[s] = silu_times(rb(w[e, g_rows] @ xs), rb(w[e, u_rows] @ xs))
    live = ids.reshape(-1) >= 0
    assert_bf16_close(np.array(act)[live], want_act[live], "act")
    want = f32(residual).copy()
    for t in range(T):
        acc = np.zeros(H, np.float32)
        for k in range(top_k):
            if ids[t, k] >= 0:
                acc += weights[t, k] * rb(f32(down)[ids[t, k]] @ f32(act)[t * top_k + k])
        want[t] = rb(want[t] + acc)
    assert_bf16_close(out, want, "combined")


@pytest.mark.parametrize("T,H", [(1, 3), (5, 2)])
def test_mla_absorb_q_with_the_latent_cache(T, H):
    """mla_absorb.cu's mla_absorb_q_cache (q_lora_rank unset) against mla_latent_cache.cu then mla_absorb_q
    on the copied query: the same q_lat, query columns and cache rows, bit for bit (a padding token of slot
    -1 writes no cache row)."""
    rng = np.random.default_rng(T * 7 + H)
    N, V, R, Dr = 24, 20, 96, 8
    qk = N + Dr
    width = H * qk + R + Dr
    y = bf16(rng.standard_normal((T, width)))
    kv_b = bf16(rng.standard_normal((H * (N + V), R)) / np.sqrt(N))
    kv_norm = bf16(1 + 0.2 * rng.standard_normal(R))
    inv_freq = (1.0 / (1e4 ** (np.arange(0, Dr, 2) / Dr))).astype(np.float32)
    positions = rng.integers(0, 500, T).astype(np.int32)
    slots = np.array([3 * t + 1 for t in range(T)], np.int32)
    if T > 1:
        slots[-1] = -1
    common = (np.float32(1e-6), host(inv_freq), np.float32(0.9), host(positions), host(slots))
    outs = []
    for fused in (False, True):
        cache = host(np.zeros((3 * T + 2, R + Dr), np.uint16))
        q_out, q_lat = host(np.zeros((T, H * qk), np.uint16)), host(np.zeros((T, H, R), np.float32))
        if fused:
            run("mla_absorb", "mla_absorb_q_cache", (-(-R // 64) + 1, H), 256,
                (host(y), host(kv_b), q_lat, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R),
                 np.int32(qk), np.int32(Dr), host(kv_norm)) + common + (cache, q_out))
        else:
            run("mla_latent_cache", "mla_latent_cache", (T,), 128,
                (host(y), np.int32(H * qk), np.int32(R), np.int32(Dr), host(kv_norm), np.uint64(0)) + common
                + (cache, q_out))
            run("mla_absorb", "mla_absorb_q", (-(-R // 64), H), 256,
                (q_out, host(kv_b), q_lat, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R),
                 np.int32(qk)))
        outs.append((np.array(q_lat), np.array(q_out), np.array(cache)))
    for name, a, b in zip(("q_lat", "q", "cache"), *outs):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert np.any(outs[0][2] != 0) and (T == 1 or not np.any(outs[0][2][3 * T - 2]))
