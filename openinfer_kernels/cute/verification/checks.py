"""GPU checks shared by the tests, the verification run and the benchmark (needs CuPy at call time).

Every check uses fresh random bf16 inputs, poisons the output with NaN first and compares with a
float32 reference: it passes when the relative Frobenius error is ≤ ``TOLERANCE`` and every output
element was written. ``CASES`` is the ordered catalogue that ``openinfer_kernels.cute.verification.run`` runs one by one
(simplest launch first: one tile and one k-tile, then more k-tiles than pipeline stages, then odd
shapes, per config; then split-K, the planned path, graph replay, grouped GEMM, attention).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace

from ..bf16 import from_bf16, to_bf16
from ..attention import ATTENTION_KERNELS
from ..configs import (FP8_GEMM_VARIANTS, FP8_VARIANTS_BY_NAME, GEMM_VARIANTS, VARIANTS_BY_NAME, GemmPlan,
                       plan_fp8_gemm, plan_gemm, silu_twin, split_count)

NAN_BF16 = 0x7FC0
HANG_SECONDS = float(os.environ.get("OPENINFER_CUTE_HANG_S", "20"))
TOLERANCE = 1e-2


def sync_or_die(what: str, stream=None, timeout_s: float | None = None) -> None:
    """Wait for the stream's work, polling; a kernel still running after ``timeout_s`` is a hang:
    report it and exit the process at once with status 3 (a blocking sync would sit there)."""
    import cupy as cp

    timeout_s = HANG_SECONDS if timeout_s is None else timeout_s
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


@dataclass(frozen=True)
class Check:
    """Outcome of one check: relative error, NaN (unwritten) outputs and a short error pattern."""

    err: float
    unwritten: int
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.err <= TOLERANCE and self.unwritten == 0


def compare(got, ref) -> Check:
    """Relative Frobenius error of ``got`` (float32, NaN = unwritten) against ``ref``, and on failure
    where it is wrong: fraction of bad elements, their row/column span, zeros, norm ratio."""
    import cupy as cp

    unwritten = int(cp.isnan(got).sum())
    diff = cp.where(cp.isnan(got), 0.0, got - ref)  # unwritten (NaN) outputs are counted apart
    err = float(cp.linalg.norm(diff) / max(float(cp.linalg.norm(ref)), 1e-30))
    if err <= TOLERANCE and unwritten == 0:
        return Check(err, unwritten)
    flat_got, flat_ref = got.reshape(got.shape[0], -1), ref.reshape(ref.shape[0], -1)
    bad = cp.abs(cp.nan_to_num(flat_got - flat_ref, nan=1e30)) > 0.05 * (cp.abs(flat_ref) + 1.0)
    rows, cols = cp.nonzero(bad.any(axis=1))[0], cp.nonzero(bad.any(axis=0))[0]
    span = (f"rows {int(rows.min())}-{int(rows.max())} cols {int(cols.min())}-{int(cols.max())}"
            if rows.size else "no element off by >5%")
    finite = cp.nan_to_num(flat_got, nan=0.0)
    ratio = float(cp.linalg.norm(finite) / max(float(cp.linalg.norm(flat_ref)), 1e-30))
    zeros = float((flat_got == 0).mean())
    detail = (f"bad={100 * float(bad.mean()):.1f}% {span} of {flat_ref.shape[0]}x{flat_ref.shape[1]} "
              f"zeros={100 * zeros:.1f}% norm(got)/norm(ref)={ratio:.3f}")
    return Check(err, unwritten, detail)


def gemm_check(runner, plan: GemmPlan | None, m: int, n: int, k: int, residual: str = "",
               padded: bool = False, prefetch: bool = False) -> Check:
    """One GEMM (``plan=None``: the launcher's own choice) against ``float32(a) @ float32(b).T``;
    ``residual``: "separate" adds a fresh R, "inplace" adds R held in the output buffer itself.
    ``padded``: A and the output are views of buffers with 300 more rows, A's NaN (the launcher
    reads whole tiles past M there), the output's a sentinel that must survive. ``prefetch``: the
    weights' ring fill issued before the programmatic-launch wait (``prefetch_weights``)."""
    import cupy as cp

    a, b = rand_bf16((m, k)), rand_bf16((n, k))
    ref = from_bf16(a) @ from_bf16(b).T
    out = cp.full((m, n), NAN_BF16, dtype=cp.uint16)
    if padded:
        big_a = cp.full((m + 300, k), NAN_BF16, dtype=cp.uint16)
        big_a[:m] = a
        a = big_a[:m]
        big_out = cp.full((m + 300, n), 0x1234, dtype=cp.uint16)
        big_out[:m] = NAN_BF16
        out = big_out[:m]
    r = None
    if residual:
        r = rand_bf16((m, n))
        ref += from_bf16(r)
        if residual == "inplace":
            out, r = r, r
    runner(a, b, out, plan=plan, residual=r, prefetch_weights=prefetch)
    sync_or_die(f"{plan.variant.name if plan else 'planned'} GEMM M={m} N={n} K={k} "
                f"S={plan.splits if plan else '-'} residual={residual or '-'}")
    if padded and bool((big_out[m:] != 0x1234).any()):
        return Check(float("inf"), 0, "rows past M of the output buffer were written")
    return compare(from_bf16(out), ref)


def swiglu_check(runner, plan: GemmPlan | None, m: int, n: int, k: int) -> Check:
    """One SiLU·up GEMM (``plan``: the plain tile whose twin runs; None: the planned one) of a
    gate_up weight interleaved in blocks of 8 rows against float32: the product rounded to bf16,
    then ``bf16(SiLU(gate))·up`` (silu_mul.cu's arithmetic). Weights are prefetched before the wait."""
    import cupy as cp

    a, b = rand_bf16((m, k)), rand_bf16((n, k))
    blocks = from_bf16(to_bf16(from_bf16(a) @ from_bf16(b).T)).reshape(m, n // 16, 2, 8)
    gate, up = blocks[:, :, 0].reshape(m, n // 2), blocks[:, :, 1].reshape(m, n // 2)
    ref = from_bf16(to_bf16(gate / (1.0 + cp.exp(-gate)))) * up
    out = cp.full((m, n // 2), NAN_BF16, dtype=cp.uint16)
    if not runner.swiglu(a, b, out, plan=plan, prefetch_weights=True):
        return Check(float("inf"), 0, "no SiLU·up twin for this plan")
    sync_or_die(f"SiLU·up GEMM {plan.variant.name if plan else 'planned'} M={m} N={n} K={k}")
    return compare(from_bf16(out), ref)


def fp8_check(runner, name: str | None, m: int, n: int, k: int) -> Check:
    """One block-scaled FP8 GEMM (``name``: an FP8 variant; None: the planned one) against float32 on the same
    e4m3 operands: ``(a · sfa) @ (b · sfb)ᵀ`` with the scales spread over their 128-blocks (which is the
    block-scaled sum). Operands: normal samples rounded to e4m3 (subnormals included), scales near 2^-8."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    from ..gemm import fp8_gemm

    rng = np.random.default_rng()

    def e4m3(rows: int):
        codes = (rng.standard_normal((rows, k)) * 32).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        return codes.view(np.uint8), codes.astype(np.float32)

    (a, a_values), (b, b_values) = e4m3(m), e4m3(n)
    sfa = (rng.uniform(0.5, 2, (k // 128, m)) * 2.0 ** -8).astype(np.float32)
    sfb = (rng.uniform(0.5, 2, (-(-n // 128), k // 128)) * 2.0 ** -6).astype(np.float32)
    ref = (a_values * np.repeat(sfa.T, 128, axis=1)) @ (b_values * np.repeat(np.repeat(sfb, 128, 0)[:n], 128, 1)).T
    out = cp.full((m, n), NAN_BF16, dtype=cp.uint16)
    variant = FP8_VARIANTS_BY_NAME[name] if name else None
    fp8_gemm(runner, cp.asarray(a), cp.asarray(sfa), cp.asarray(b), cp.asarray(sfb), out, variant=variant,
             prefetch_weights=True)
    sync_or_die(f"FP8 GEMM {name or plan_fp8_gemm(m, n, k).name} M={m} N={n} K={k}")
    return compare(from_bf16(out), cp.asarray(ref))


def graph_check(runner, m: int, n: int, k: int) -> Check:
    """The planned GEMM captured in a CUDA graph and replayed must equal the eager launch bit for bit."""
    import cupy as cp

    a, b = rand_bf16((m, k)), rand_bf16((n, k))
    eager, graphed = cp.empty((m, n), cp.uint16), cp.full((m, n), NAN_BF16, cp.uint16)
    runner.reserve_workspace(m, [(n, k)])
    runner(a, b, eager)
    sync_or_die(f"eager GEMM M={m} N={n} K={k}")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        runner(a, b, graphed, stream=stream)
        graph = stream.end_capture()
        graph.launch(stream)
        sync_or_die(f"graph-replayed GEMM M={m} N={n} K={k}", stream)
    check = compare(from_bf16(graphed), from_bf16(eager))
    same = bool(cp.array_equal(eager, graphed))
    return Check(0.0 if same else max(check.err, 2 * TOLERANCE), check.unwritten,
                 "" if same else f"graph replay differs from eager: {check.detail or f'err={check.err:.2e}'}")


def grouped_check(runner, tile_m: int, tokens: int, top_k: int, experts: int, n: int, k: int) -> Check:
    """One grouped GEMM with random routing, checked on the rows that carry assignments."""
    import cupy as cp
    import numpy as np

    from ..gemm import grouped_gemm
    from ..moe import group_by_expert

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
    return compare(got, ref)


def attention_check(runner, lengths_q, lengths_k, hq: int, hkv: int, kernel: str) -> Check:
    """One varlen causal attention by ``kernel``; the error is the worst over (sequence, head)."""
    import cupy as cp
    import numpy as np

    from ..attention import ATTENTION_BY_NAME, attention_work, varlen_attention

    d = ATTENTION_BY_NAME[kernel].head_dim
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rand_bf16((int(cu_q[-1]), hq, d))
    k, v = rand_bf16((int(cu_k[-1]), hkv, d)), rand_bf16((int(cu_k[-1]), hkv, d))
    o = cp.full(q.shape, NAN_BF16, dtype=cp.uint16)
    varlen_attention(runner, q, k, v, o, cp.asarray(cu_q), cp.asarray(cu_k), cp.asarray(attention_work(cu_q)),
                     kernel=kernel)
    sync_or_die(f"{kernel} hq={hq} hkv={hkv} lengths={list(lengths_q)[:8]}")
    got = from_bf16(o)
    worst, unwritten = Check(0.0, 0), 0
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        lq, lk = int(lengths_q[b]), int(lengths_k[b])
        if lq == 0:
            continue
        visible = cp.arange(lk)[None, :] <= cp.arange(lq)[:, None] + (lk - lq)
        for h in range(hq):
            kv = h // (hq // hkv)
            s = from_bf16(q[qs, h]) @ from_bf16(k[ks, kv]).T / np.sqrt(float(d))
            s = cp.where(visible, s, -cp.inf)
            p = cp.exp(s - s.max(axis=1, keepdims=True))
            one = compare(got[qs, h], (p / p.sum(axis=1, keepdims=True)) @ from_bf16(v[ks, kv]))
            unwritten += one.unwritten
            if one.err > worst.err:
                worst = Check(one.err, 0, f"worst: seq {b} (len_q={lq}, len_k={lk}) head {h}: {one.detail}")
    return Check(worst.err, unwritten, worst.detail if not (worst.err <= TOLERANCE and unwritten == 0) else "")


# ---- the ordered catalogue ---------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One verification launch: ``group`` is the kernel config (or path) under test."""

    group: str
    label: str
    kind: str  # gemm | residual | planned | prefetch | padded | graph | swiglu | grouped | attention | fp8
    args: tuple


MULTI_K = 1032  # 17 k-tiles, more than any config's pipeline stages (≤ 14), with a K tail of 8
ODD_SHAPES = ((1, 200, 328), (17, 2056, 1032), (255, 392, 2568), (1000, 1288, 520))
# Every built variant gets cases: the simplest config first (the first launch a run probes), then
# the catalogue's order (producer-warpgroup twins last), so a new variant needs no entry here.
SIMPLEST = "gemm_bf16_64x128_c1x1"
DENSE_ORDER = (SIMPLEST,) + tuple(v.name for v in GEMM_VARIANTS
                                  if v.out == "bf16" and not (v.grouped or v.residual or v.silu) and v.name != SIMPLEST)
# SiLU·up twins: N a multiple of 16 (gate and up interleaved in 8s), tails in M, N and K
SILU_SHAPES = ((1, 208, 328), (17, 2064, 1032), (255, 400, 2568), (1000, 1296, 520))
SPLITK_ORDER = tuple(v.name for v in GEMM_VARIANTS if v.out == "f32")
FP8_SHAPES = ((1, 208, 384), (17, 2064, 1152), (255, 400, 2560), (1000, 1296, 512))   # K % 128, N % 16


_MIX = (1, 17, 64, 130, 1000, 4096, 0, 63)
ATTENTION_SHAPES = (  # (lengths_q, lengths_k, hq, hkv)
    ((64,), (64,), 1, 1), ((1000,), (1000,), 2, 1),
    (_MIX, _MIX, 8, 8), (_MIX, _MIX, 8, 2), (_MIX, _MIX, 8, 1),
    ((5, 200, 1), (300, 200, 129), 4, 1),  # cached prefixes not a multiple of 64 (half tiles fully masked)
    ((8192, 700), (8192, 2700), 8, 2),     # 64 / 22 k-tiles, cached prefix
    ((16384,), (16384,), 32, 8))           # the 16k benchmark shape, 128 k-tiles


def _rows(name: str, m: int) -> int:
    """A case's M for a variant: at most its ``a_rows`` where it loads only that many rows of A."""
    a_rows = VARIANTS_BY_NAME[name].a_rows
    return min(m, a_rows) if a_rows else m


def _gemm_case(name: str, m: int, n: int, k: int, splits: int = 1, residual: str = "") -> Case:
    m = _rows(name, m)
    suffix = f" S={split_count(k, splits)}" if VARIANTS_BY_NAME[name].out == "f32" else ""
    suffix += f" + R ({residual})" if residual else ""
    return Case(name, f"M={m} N={n} K={k}{suffix}", "gemm", (name, splits, m, n, k, residual))


def build_cases() -> tuple[Case, ...]:
    cases = []
    for name in DENSE_ORDER:
        v = VARIANTS_BY_NAME[name]
        cases.append(_gemm_case(name, v.tile_m, v.tile_n, 64))         # one tile, one k-tile
        cases.append(_gemm_case(name, v.tile_m, v.tile_n, MULTI_K))    # k-tiles > stages
        cases += [_gemm_case(name, m, n, k) for m, n, k in ODD_SHAPES]
        cases.append(_gemm_case(name, 17 * v.tile_m + 5, 264, 200))    # > 8 M-tiles: raster tail
    for v in GEMM_VARIANTS:
        if v.silu:
            plain = replace(v, silu=False).name
            shapes = ((v.tile_m, v.tile_n, 64), (v.tile_m, v.tile_n, MULTI_K)) + SILU_SHAPES + \
                ((17 * v.tile_m + 5, 272, 200),)
            cases += [Case(v.name, f"M={_rows(plain, m)} N={n} K={k}", "swiglu", (plain, _rows(plain, m), n, k))
                      for m, n, k in shapes]
    for m, n, k in ((8, 19456, 2560), (96, 19456, 2560), (32, 24576, 4096), (128, 24576, 4096)):
        cases.append(Case("swiglu", f"M={m} N={n} K={k} {silu_twin(plan_gemm(m, n, k)).name}", "swiglu",
                          (None, m, n, k)))
    for v in GEMM_VARIANTS:
        if v.residual:  # R in a buffer of its own and R in the output buffer, tails in M, N and K
            cases.append(_gemm_case(v.name, v.tile_m, v.tile_n, 64, residual="separate"))
            cases.append(_gemm_case(v.name, 255, 392, 2568, residual="inplace"))
            cases.append(_gemm_case(v.name, 1000, 1288, 520, residual="separate"))
    for m, n, k in ((1, 2560, 4096), (17, 2056, 1032), (300, 2560, 9728), (1000, 6144, 2560)):
        for how in ("separate", "inplace"):  # the planned path: split-K (reduction adds R) and tiles
            cases.append(Case("residual", f"M={m} N={n} K={k} {plan_gemm(m, n, k).variant.name} + R ({how})",
                              "residual", (m, n, k, how)))
    for name in SPLITK_ORDER:
        v = VARIANTS_BY_NAME[name]
        cases.append(_gemm_case(name, v.tile_m, v.tile_n, 64))         # S=1 through the reduce
        cases.append(_gemm_case(name, v.tile_m, v.tile_n, MULTI_K, 2))
        cases.append(_gemm_case(name, 3, 136, MULTI_K, 3))
        cases.append(_gemm_case(name, 17, 2056, MULTI_K, 4))
        cases.append(_gemm_case(name, 1, 200, 328, 16))                # one k-tile per split
    for n, k in ((6144, 2560), (2560, 9728)):
        for m in (1, 17, 64, 255, 1000) + ((2048,) if n == 2560 else ()):  # 2048: the 320-wide tile
            cases.append(Case("planned", f"M={m} N={n} K={k} {plan_gemm(m, n, k).variant.name}"
                              f"/S{plan_gemm(m, n, k).splits}", "planned", (m, n, k)))
    # A read past M to whole tiles: streams, 192-row tiles, K pairs (one and two rows), 128-row tiles
    for m, n, k in ((1, 2560, 4096), (17, 6144, 2560), (96, 4096, 4096), (160, 2560, 4096), (193, 2560, 4096),
                    (300, 4096, 4096), (1000, 2056, 1032)):
        plan = plan_gemm(m, n, k)
        cases.append(Case("padded", f"M={m} N={n} K={k} {plan.variant.name}/S{plan.splits}", "padded", (m, n, k)))
    # the weights' ring fill before the wait (prefetch_weights): streams split and unsplit, 192-row
    # tiles, A- and B-multicast tiles, a K pair
    for m, n, k in ((1, 2560, 4096), (17, 6144, 2560), (64, 19456, 2560), (160, 2560, 4096), (1000, 2560, 4096),
                    (2048, 6144, 2560), (300, 2560, 4096)):
        plan = plan_gemm(m, n, k)
        cases.append(Case("prefetch", f"M={m} N={n} K={k} {plan.variant.name}/S{plan.splits}", "prefetch", (m, n, k)))
    for m in (8, 300):
        cases.append(Case("graph", f"M={m} N=2560 K=4096", "graph", (m, 2560, 4096)))
    for v in FP8_GEMM_VARIANTS:  # one tile and one k-tile, k-tiles > stages, tails in M and N, partial scale blocks
        for m, n, k in ((v.tile_m, v.tile_n, 128), (v.tile_m, v.tile_n, 17 * 128)) + FP8_SHAPES + \
                ((17 * v.tile_m + 5, 576, 256),):
            cases.append(Case(v.name, f"M={m} N={n} K={k}", "fp8", (v.name, m, n, k)))
    for m, n, k in ((1, 6144, 4096), (64, 4096, 12288), (300, 24576, 4096), (2048, 4096, 4096)):
        cases.append(Case("fp8_planned", f"M={m} N={n} K={k} {plan_fp8_gemm(m, n, k).name}", "fp8", (None, m, n, k)))
    for args in ((64, 37, 8, 16, 264, 520), (64, 1, 8, 64, 768, 2048), (128, 300, 2, 8, 1536, 2048)):
        cases.append(Case(f"grouped_bf16_{args[0]}x128_c1x1", "tokens={1} top_k={2} experts={3} N={4} K={5}"
                          .format(*args), "grouped", args))
    for kernel in ATTENTION_KERNELS:
        for lengths_q, lengths_k, hq, hkv in ATTENTION_SHAPES:
            label = f"q={list(lengths_q)} k={'same' if lengths_k == lengths_q else list(lengths_k)} hq={hq} hkv={hkv}"
            cases.append(Case(kernel, label, "attention", (lengths_q, lengths_k, hq, hkv, kernel)))
    assert {c.group for c in cases if c.kind in ("gemm", "swiglu")} - {"swiglu"} == \
        {v.name for v in GEMM_VARIANTS if not v.grouped}
    return tuple(cases)


CASES = build_cases()


def run_case(runner, case: Case) -> Check:
    """Run one catalogue case on the current device."""
    if case.kind == "gemm":
        name, splits, m, n, k, residual = case.args
        return gemm_check(runner, GemmPlan(VARIANTS_BY_NAME[name], splits), m, n, k, residual)
    if case.kind == "residual":
        m, n, k, how = case.args
        return gemm_check(runner, None, m, n, k, how)
    if case.kind == "planned":
        return gemm_check(runner, None, *case.args)
    if case.kind == "prefetch":
        return gemm_check(runner, None, *case.args, prefetch=True)
    if case.kind == "padded":
        return gemm_check(runner, None, *case.args, padded=True)
    if case.kind == "swiglu":
        name, m, n, k = case.args
        return swiglu_check(runner, name and GemmPlan(VARIANTS_BY_NAME[name]), m, n, k)
    if case.kind == "graph":
        return graph_check(runner, *case.args)
    if case.kind == "grouped":
        return grouped_check(runner, *case.args)
    if case.kind == "attention":
        return attention_check(runner, *case.args)
    if case.kind == "fp8":
        return fp8_check(runner, *case.args)
    raise ValueError(f"unknown case kind {case.kind!r}")
