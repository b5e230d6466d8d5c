"""GPU check shared by the tests and the benchmark: one GEMM against a float32 reference (needs CuPy)."""
from __future__ import annotations

import os
import sys
import time

from .bf16 import from_bf16, to_bf16
from .configs import GemmPlan

NAN_BF16 = 0x7FC0
HANG_SECONDS = 20.0


def sync_or_die(what: str, stream=None, timeout_s: float = HANG_SECONDS) -> None:
    """Wait for the stream's work, polling; a kernel still running after ``timeout_s`` is a hang:
    report it and exit the process at once (a blocking sync would sit there until killed)."""
    import cupy as cp

    done = cp.cuda.Event(disable_timing=True)
    done.record(stream)
    deadline = time.monotonic() + timeout_s
    while not done.done:
        if time.monotonic() > deadline:
            print(f"HANG: {what} did not finish in {timeout_s:.0f} s; exiting", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.0005)


def rand_bf16(shape):
    """Fresh standard-normal bf16 (uint16 bits) on the current device."""
    import cupy as cp

    return to_bf16(cp.random.standard_normal(shape, dtype=cp.float32))


def gemm_error(runner, plan: GemmPlan | None, m: int, n: int, k: int) -> tuple[float, int]:
    """(relative Frobenius error, unwritten elements) of one GEMM with fresh inputs, NaN-poisoned output."""
    import cupy as cp

    a, b = rand_bf16((m, k)), rand_bf16((n, k))
    out = cp.full((m, n), NAN_BF16, dtype=cp.uint16)
    runner(a, b, out, plan=plan)
    sync_or_die(f"{plan.variant.name if plan else 'planned'} GEMM M={m} N={n} K={k} S={plan.splits if plan else '-'}")
    got = from_bf16(out)
    ref = from_bf16(a) @ from_bf16(b).T
    unwritten = int(cp.isnan(got).sum())
    err = float(cp.linalg.norm(cp.nan_to_num(got - ref, nan=1e30)) / cp.linalg.norm(ref))
    return err, unwritten


def grouped_error(runner, tile_m: int, tokens: int, top_k: int, experts: int, n: int, k: int) -> tuple[float, int]:
    """(relative error, unwritten used rows) of one grouped GEMM with random routing."""
    import cupy as cp
    import numpy as np

    from .gemm import grouped_gemm
    from .moe import group_by_expert

    ids = np.random.default_rng().integers(0, experts, size=(tokens, top_k))
    groups = group_by_expert(ids, experts, tile_m)
    x, w = rand_bf16((tokens, k)), rand_bf16((experts, n, k))
    rows = cp.asarray(groups.rows.reshape(-1))
    a = cp.zeros((groups.padded_rows, k), cp.uint16)
    a[rows] = cp.repeat(x, top_k, axis=0)
    out = cp.full((groups.padded_rows, n), NAN_BF16, dtype=cp.uint16)
    grouped_gemm(runner, a, w, cp.asarray(groups.tile_expert), out)
    sync_or_die(f"grouped GEMM tile_m={tile_m} tokens={tokens} experts={experts} N={n} K={k}")
    got = from_bf16(out[rows])
    x_rows, experts_of = from_bf16(cp.repeat(x, top_k, axis=0)), ids.reshape(-1)
    ref = cp.empty_like(got)
    for e in np.unique(experts_of):
        mine = cp.asarray(np.nonzero(experts_of == e)[0])
        ref[mine] = x_rows[mine] @ from_bf16(w[int(e)]).T
    unwritten = int(cp.isnan(got).sum())
    err = float(cp.linalg.norm(cp.nan_to_num(got - ref, nan=1e30)) / cp.linalg.norm(ref))
    return err, unwritten


def attention_error(runner, lengths_q, lengths_k, hq: int, hkv: int) -> tuple[float, int]:
    """(worst per-sequence relative error, unwritten outputs) of one varlen causal attention."""
    import cupy as cp
    import numpy as np

    from .attention import attention_work, varlen_attention

    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rand_bf16((int(cu_q[-1]), hq, 128))
    k, v = rand_bf16((int(cu_k[-1]), hkv, 128)), rand_bf16((int(cu_k[-1]), hkv, 128))
    o = cp.full(q.shape, NAN_BF16, dtype=cp.uint16)
    varlen_attention(runner, q, k, v, o, cp.asarray(cu_q), cp.asarray(cu_k), cp.asarray(attention_work(cu_q)))
    sync_or_die(f"varlen attention hq={hq} hkv={hkv} lengths={list(lengths_q)[:8]}")
    got = from_bf16(o)
    worst = 0.0
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        lq, lk = int(lengths_q[b]), int(lengths_k[b])
        if lq == 0:
            continue
        visible = cp.arange(lk)[None, :] <= cp.arange(lq)[:, None] + (lk - lq)
        for h in range(hq):
            kv = h // (hq // hkv)
            s = from_bf16(q[qs, h]) @ from_bf16(k[ks, kv]).T / np.sqrt(128.0)
            s = cp.where(visible, s, -cp.inf)
            p = cp.exp(s - s.max(axis=1, keepdims=True))
            ref = (p / p.sum(axis=1, keepdims=True)) @ from_bf16(v[ks, kv])
            diff = cp.nan_to_num(got[qs, h] - ref, nan=1e30)
            worst = max(worst, float(cp.linalg.norm(diff) / cp.linalg.norm(ref)))
    return worst, int(cp.isnan(got).sum())
