"""The GPU verification runner on the CPU: hangs, crashes and errors of a (fake) worker are each
recorded against the right case, a fresh worker resumes after them, and the catalogue is sound."""
import sys
import textwrap

from kernels.cute.configs import GEMM_VARIANTS
from kernels.cute.testing import CASES, Case
from kernels.cute.verify import passing_groups, probe_first_order, run_all, table

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
    assert {"planned", "graph", "varlen_attention"} <= set(groups)
    assert sorted(order) == list(range(len(CASES)))


def test_compare_locates_the_wrong_block(monkeypatch):
    import numpy as np

    from kernels.cute.testing import compare

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

    from kernels.cute import verify

    monkeypatch.setattr(verify, "BUDGET_GRACE_S", 0.5)
    t0 = time.monotonic()
    res, _ = _run(tmp_path, monkeypatch, ["a", "b", "c"], {1: "STALL"}, budget=1.0)
    assert [res[i].status for i in range(3)] == ["PASS", "SKIP", "SKIP"]
    assert "while it ran" in res[1].detail and time.monotonic() - t0 < 5
