"""The GPU verification runner on the CPU: hangs, crashes and errors of a (fake) worker are each
recorded against the right case, a fresh worker resumes after them, and the catalogue is sound."""
import sys

import numpy as np
import pytest
import textwrap

from openinfer_kernels.cute.configs import GEMM_VARIANTS
from openinfer_kernels.cute.verification.checks import CASES, Case
from openinfer_kernels.cute.verification.run import passing_groups, probe_first_order, run_all, table

# Fake worker: argv[1] = "i,j,..."; behaviour of case i from BEHAVIOUR (default PASS).
FAKE_WORKER = textwrap.dedent("""
    import os, sys, time
    BEHAVIOUR = dict(x.split(":") for x in os.environ["FAKE"].split(",") if x)
    print("[worker] ready", flush=True)
    for i in sys.argv[1].split(","):
        what = BEHAVIOUR.get(i, "PASS")
        print(f"@start {i} g label", flush=True)
        if what == "WATCHDOG":
            print("HANG: fake kernel did not finish", file=sys.stderr, flush=True)
            os._exit(3)
        if what == "STALL":
            time.sleep(60)
        if what == "CRASH":
            os._exit(139)
        if what == "ERROR":
            print(f"@done {i} ERROR KernelLaunchError: launch failed with CUDA error 700", flush=True)
            sys.exit(4)
        print(f"@done {i} {what} err=1.0e-03 unwritten=0", flush=True)
""")


def _cases(groups):
    return tuple(Case(g, f"case {i}", "gemm", ()) for i, g in enumerate(groups))


def _run(tmp_path, monkeypatch, groups, behaviour, budget=60.0):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setenv("FAKE", ",".join(f"{i}:{b}" for i, b in behaviour.items()))
    log = []
    results = run_all(_cases(groups), [sys.executable, str(script)], budget, case_timeout_s=1.5, log=log.append)
    return {r.index: r for r in results}, log


def test_each_failure_mode_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    res, log = _run(tmp_path, monkeypatch, groups,
                    {1: "FAIL", 2: "WATCHDOG", 4: "STALL", 5: "CRASH", 6: "ERROR"})
    status = {i: r.status for i, r in res.items()}
    assert status == {0: "PASS", 1: "FAIL", 2: "HANG", 3: "PASS", 4: "HANG", 5: "ERROR", 6: "ERROR", 7: "PASS"}
    assert res[2].detail == "watchdog fired" and res[4].detail == "no answer: killed"
    assert "139" in res[5].detail and "CUDA error 700" in res[6].detail
    assert passing_groups(list(res.values())) == []  # every group has a non-passing case
    text = table(list(res.values()))
    assert "8 cases, 3 PASS, 1 FAIL, 2 HANG, 2 ERROR" in text and "HANG  #4 case 4: no answer: killed" in text


def test_a_group_that_hangs_twice_is_skipped(tmp_path, monkeypatch):
    res, _ = _run(tmp_path, monkeypatch, ["a", "b", "a", "a", "a"], {0: "WATCHDOG", 2: "WATCHDOG"})
    assert [res[i].status for i in range(5)] == ["HANG", "PASS", "HANG", "SKIP", "SKIP"]
    assert passing_groups(list(res.values())) == ["b"]


def test_only_the_chosen_cases_run(tmp_path, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setenv("FAKE", "1:FAIL")
    results = run_all(_cases(["a", "b", "c", "d"]), [sys.executable, str(script)], 60.0, 1.5, lambda _: None,
                      only={1, 3})
    assert [(r.index, r.status) for r in results] == [(1, "FAIL"), (3, "PASS")]


def test_spent_budget_skips_the_rest(tmp_path, monkeypatch):
    res, _ = _run(tmp_path, monkeypatch, ["a", "b"], {}, budget=0.0)
    assert {r.status for r in res.values()} == {"SKIP"}


def test_a_worker_that_cannot_start_ends_the_run(tmp_path, monkeypatch):
    log = []
    results = run_all(_cases(["a", "b"]), [sys.executable, "-c", "import sys; sys.exit(1)"], 60.0, 1.0, log.append)
    assert [r.status for r in results] == ["ERROR", "ERROR"]


def test_catalogue_probes_every_kernel_first_with_the_simplest_launch():
    order = probe_first_order(CASES)
    groups = list(dict.fromkeys(c.group for c in CASES))
    probes = [CASES[i] for i in order[:len(groups)]]
    assert [c.group for c in probes] == groups  # one probe per group, catalogue order
    assert probes[0].label == "M=64 N=128 K=64"  # one tile, one k-tile of the simplest config
    assert {v.name for v in GEMM_VARIANTS} <= set(groups)
    assert {"planned", "graph", "varlen_attention", "varlen_attention_ws"} <= set(groups)
    assert sorted(order) == list(range(len(CASES)))


def test_compare_locates_the_wrong_block(monkeypatch):
    import numpy as np

    from openinfer_kernels.cute.verification.checks import compare

    monkeypatch.setitem(sys.modules, "cupy", np)  # compare() uses only the NumPy-compatible API
    ref = np.random.default_rng(0).standard_normal((40, 24)).astype(np.float32)
    assert compare(ref.copy(), ref).ok
    got = ref.copy()
    got[16:32, 8:16] = 0.0  # a tile never accumulated
    got[0, 0] = np.nan      # and one element never written
    check = compare(got, ref)
    assert not check.ok and check.unwritten == 1 and check.err > 0.1
    assert "rows 0-31 cols 0-15" in check.detail and "of 40x24" in check.detail


def test_a_case_running_past_the_budget_is_cut_off(tmp_path, monkeypatch):
    import time

    from openinfer_kernels.cute.verification import run as verify

    monkeypatch.setattr(verify, "BUDGET_GRACE_S", 0.5)
    t0 = time.monotonic()
    res, _ = _run(tmp_path, monkeypatch, ["a", "b", "c"], {1: "STALL"}, budget=1.0)
    assert [res[i].status for i in range(3)] == ["PASS", "SKIP", "SKIP"]
    assert "while it ran" in res[1].detail and time.monotonic() - t0 < 5


class _FakeCupy:
    """NumPy standing in for CuPy, so the GPU checks' own code runs on the CPU."""

    def __init__(self):
        import types

        import numpy as np

        rng = np.random.default_rng(1)
        self._np = np
        self.random = types.SimpleNamespace(standard_normal=lambda shape, dtype: rng.standard_normal(shape, dtype=dtype))
        event = type("Event", (), {"__init__": lambda self, **kw: None, "record": lambda self, s=None: None,
                                   "done": True})
        self.cuda = types.SimpleNamespace(Event=event)

    def __getattr__(self, name):
        return getattr(self._np, name)


def _numpy_gemm(a, b, out, plan=None, residual=None, prefetch_weights=False, broken=False, drop_residual=False):
    from openinfer_kernels.cute.bf16 import from_bf16, to_bf16

    res = from_bf16(a) @ from_bf16(b).T
    if residual is not None and not drop_residual:
        res += from_bf16(residual)
    if broken:
        res[:, 64:] = 0.0  # a kernel that skips every N-tile but the first
    out[...] = to_bf16(res)


def test_checks_pass_a_correct_kernel_and_locate_a_broken_one(monkeypatch):
    from openinfer_kernels.cute.verification import checks as testing

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())
    good = testing.gemm_check(_numpy_gemm, None, 17, 200, 72)
    assert good.ok and good.unwritten == 0 and good.err < 5e-3
    bad = testing.gemm_check(lambda a, b, out, plan=None, residual=None, prefetch_weights=False: _numpy_gemm(a, b, out, broken=True),
                             None, 17, 200, 72)
    assert not bad.ok and "cols 64-199" in bad.detail


def _numpy_fp8_gemm(runner, a, a_scales, b, b_scales, out, variant=None, prefetch_weights=False, broken=False):
    """The block-scaled FP8 product block by block from the e4m3 bytes (broken: B's first scale block for all N)."""
    import ml_dtypes

    from openinfer_kernels.cute.bf16 import to_bf16

    av, bv = (np.asarray(x).view(ml_dtypes.float8_e4m3fn).astype(np.float64) for x in (a, b))
    res = np.zeros(out.shape)
    for kb in range(av.shape[1] // 128):
        part = av[:, kb * 128:(kb + 1) * 128] @ bv[:, kb * 128:(kb + 1) * 128].T
        sb = np.repeat(b_scales[:, kb], 128)[:b.shape[0]] if not broken else b_scales[0, kb]
        res += part * a_scales[kb, :a.shape[0], None] * sb
    out[...] = to_bf16(res.astype(np.float32))


def test_fp8_check_passes_the_block_scaled_product_and_fails_a_wrong_scale(monkeypatch):
    from openinfer_kernels.cute.verification import checks as testing

    gemm = sys.modules["openinfer_kernels.cute.gemm"]  # the package's `gemm` attribute is the function
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())
    monkeypatch.setattr(gemm, "fp8_gemm", _numpy_fp8_gemm)
    good = testing.fp8_check(None, None, 17, 272, 384)
    assert good.ok and good.err < 5e-3
    monkeypatch.setattr(gemm, "fp8_gemm", lambda *a, **kw: _numpy_fp8_gemm(*a, **kw, broken=True))
    assert not testing.fp8_check(None, None, 17, 272, 384).ok


@pytest.mark.parametrize("how", ["separate", "inplace"])
def test_residual_check_needs_the_residual_added(monkeypatch, how):
    from openinfer_kernels.cute.verification import checks as testing

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())
    assert testing.gemm_check(_numpy_gemm, None, 17, 200, 72, residual=how).ok
    ignored = testing.gemm_check(lambda *a, **kw: _numpy_gemm(*a, **kw, drop_residual=True), None, 17, 200, 72,
                                 residual=how)
    assert not ignored.ok


def test_attention_check_agrees_with_an_independent_causal_attention(monkeypatch):
    import numpy as np

    from openinfer_kernels.cute import attention
    from openinfer_kernels.cute.verification import checks as testing
    from openinfer_kernels.cute.bf16 import from_bf16, to_bf16

    def numpy_attention(runner, q, k, v, o, cu_q, cu_k, work, stream=None, kernel=None):
        hq, hkv = q.shape[1], k.shape[1]
        for b in range(len(cu_q) - 1):
            lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            for t in range(lq):  # query t sees keys up to t + lk - lq
                for h in range(hq):
                    keys = slice(cu_k[b], cu_k[b] + t + lk - lq + 1)
                    s = from_bf16(k[keys, h * hkv // hq]) @ from_bf16(q[cu_q[b] + t, h]) / np.sqrt(128.0)
                    p = np.exp(s - s.max())
                    o[cu_q[b] + t, h] = to_bf16(p @ from_bf16(v[keys, h * hkv // hq]) / p.sum())

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())
    monkeypatch.setattr(attention, "varlen_attention", numpy_attention)
    check = testing.attention_check(None, [3, 0, 20], [9, 0, 20], 4, 2, "varlen_attention_ws")
    assert check.ok, (check.err, check.detail)
    monkeypatch.setattr(attention, "varlen_attention",
                        lambda *args, **kw: (numpy_attention(*args), args[4].__setitem__((slice(None), 3), 0)))
    check = testing.attention_check(None, [3, 0, 20], [9, 0, 20], 4, 2, "varlen_attention_ws")
    assert not check.ok and "head 3" in check.detail


def test_grouped_check_agrees_with_a_per_tile_expert_gemm(monkeypatch):
    from openinfer_kernels.cute.verification import checks as testing
    from openinfer_kernels.cute.bf16 import from_bf16, to_bf16

    gemm = sys.modules["openinfer_kernels.cute.gemm"]  # the package's `gemm` attribute is the function

    def numpy_grouped(runner, a, w, tile_expert, out, stream=None):
        tile_m = a.shape[0] // tile_expert.shape[0]
        for t, e in enumerate(tile_expert):
            rows = slice(t * tile_m, (t + 1) * tile_m)
            out[rows] = to_bf16(from_bf16(a[rows]) @ from_bf16(w[e]).T)

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())
    monkeypatch.setattr(gemm, "grouped_gemm", numpy_grouped)
    check = testing.grouped_check(None, 64, 9, 2, 4, 24, 16)
    assert check.ok, (check.err, check.detail)
    monkeypatch.setattr(gemm, "grouped_gemm", lambda r, a, w, te, out: numpy_grouped(r, a, w, te[::-1].copy(), out))
    assert not testing.grouped_check(None, 64, 9, 2, 4, 24, 16).ok  # tiles given the wrong experts


def test_catalogue_verifies_attention_as_long_as_the_benchmark_runs_it():
    """The benchmark timed 16k-token attention that no verification case had run (and hung)."""
    from bench.kernels import ATTN_ROWS
    from openinfer_kernels.cute.attention import ATTENTION_KERNELS

    longest_row = max(max(k) for _, k in ATTN_ROWS.values())
    for kernel in ATTENTION_KERNELS:  # each kernel verified on sequences as long as it is timed on
        attention = [c.args for c in CASES if c.kind == "attention" and c.group == kernel]
        assert max(max(lengths_k) for _, lengths_k, *_ in attention) >= longest_row, kernel
        assert any(max(q) >= 8192 and list(k) != list(q) for q, k, *_ in attention)  # long, cached prefix
