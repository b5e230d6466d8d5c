"""GPU verification of every compiled kernel, one case at a time, surviving hangs and crashes.

    python3 -m openinfer_kernels.cute.verification.run [--out DIR] [--budget SECONDS] [--hang-s SECONDS]

The parent process never touches the GPU. It runs the cases of ``testing.CASES`` in a worker
process (``--worker``) that prints ``@start i`` / ``@done i STATUS detail`` for each. A kernel that
does not finish within ``--hang-s`` makes the worker exit with status 3 (``testing.sync_or_die``);
a worker that stops answering is killed; a CUDA error ends the worker (its context is broken).
Either way the case is recorded (HANG / ERROR) and a fresh worker resumes with the next case.
Order: first one probe per kernel (the first case of each group: one tile, one k-tile), then the
rest. A group that hangs twice is skipped; past ``--budget`` seconds the rest is skipped. Writes
``verify.json`` and ``verify_log.txt`` under ``--out`` and prints a compact table.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .checks import CASES, Case

REPO = Path(__file__).resolve().parents[3]
MAX_HANGS_PER_GROUP = 2
SHOWN_PER_GROUP = 4  # non-passing cases listed per group in the table (all are in verify.json)
BUDGET_GRACE_S = 15.0  # a case running when the budget ends gets this long to finish
STARTUP_S = 60.0  # a worker must print its first line (CuPy import, module load) within this


@dataclass
class Result:
    index: int
    group: str
    label: str
    status: str  # PASS | FAIL | HANG | ERROR | SKIP
    detail: str = ""
    seconds: float = 0.0


def probe_first_order(cases: tuple[Case, ...]) -> list[int]:
    """Indices with the first case of every group first (catalogue order), then the rest."""
    seen, probes, rest = set(), [], []
    for i, case in enumerate(cases):
        (rest if case.group in seen else probes).append(i)
        seen.add(case.group)
    return probes + rest


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """Give a worker ``grace_s`` to exit by itself, then kill its process group."""
    try:
        proc.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass  # stuck in the driver: leave it, the next worker gets a fresh context


class _Run:
    """Bookkeeping of one verification run."""

    def __init__(self, cases: tuple[Case, ...], only: set[int] | None = None):
        self.cases = cases
        self.results: dict[int, Result] = {}
        self.hangs: dict[str, int] = {}
        self.todo = [i for i in probe_first_order(cases) if only is None or i in only]

    def record(self, i: int, status: str, detail: str = "", seconds: float = 0.0) -> None:
        self.results[i] = Result(i, self.cases[i].group, self.cases[i].label, status, detail, round(seconds, 2))
        if i in self.todo:
            self.todo.remove(i)
        if status == "HANG":
            group = self.cases[i].group
            self.hangs[group] = self.hangs.get(group, 0) + 1
            if self.hangs[group] >= MAX_HANGS_PER_GROUP:
                for j in [j for j in self.todo if self.cases[j].group == group]:
                    self.record(j, "SKIP", f"group hung {MAX_HANGS_PER_GROUP} times")

    def give_up(self, why: str, status: str = "SKIP") -> None:
        for i in list(self.todo):
            self.record(i, status, why)


def run_all(cases: tuple[Case, ...], worker_cmd: list[str], budget_s: float, case_timeout_s: float,
            log, only: set[int] | None = None) -> list[Result]:
    """Run every case (or the indices in ``only``) through workers started with
    ``worker_cmd + ["i,j,..."]``; see the module doc."""
    t0 = time.monotonic()
    run = _Run(cases, only)
    startup_failures = 0
    while run.todo:
        if time.monotonic() - t0 > budget_s:
            run.give_up("time budget spent")
            break
        proc = subprocess.Popen(worker_cmd + [",".join(map(str, run.todo))], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        current, since, answered, stalled, over = None, time.monotonic(), False, False, False
        tail: list[str] = []
        while True:
            wait = min((case_timeout_s if answered else STARTUP_S) - (time.monotonic() - since),
                       budget_s + BUDGET_GRACE_S - (time.monotonic() - t0))
            try:
                line = lines.get(timeout=max(wait, 0.01))
            except queue.Empty:
                over = time.monotonic() - t0 >= budget_s + BUDGET_GRACE_S - 0.05
                stalled = not over
                break
            if line is None:
                break
            log(line)
            tail = (tail + [line])[-12:]
            words = line.split(" ", 3)
            if words[0] == "@start" and len(words) > 1:
                current, since, answered = int(words[1]), time.monotonic(), True
            elif words[0] == "@done" and len(words) > 2:
                run.record(int(words[1]), words[2], words[3] if len(words) > 3 else "", time.monotonic() - since)
                current, since = None, time.monotonic()
                if time.monotonic() - t0 > budget_s:
                    over = True
                    break
        _stop(proc, 0.0 if stalled or over else 10.0)
        rc = proc.returncode
        if current is not None and over:
            run.record(current, "SKIP", "time budget spent while it ran", time.monotonic() - since)
        elif current is not None:  # the case that was running when the worker ended
            hang = stalled or rc == 3
            why = "no answer: killed" if stalled else "watchdog fired" if rc == 3 else f"worker died, status {rc}"
            run.record(current, "HANG" if hang else "ERROR", why, time.monotonic() - since)
        elif not answered:  # died or stalled before its first case: an environment problem
            startup_failures += 1
            log("[verify] worker failed before its first case:\n[verify]   " + "\n[verify]   ".join(tail))
            if startup_failures >= 2:
                run.give_up(f"worker could not start (status {rc}); see the log", "ERROR")
                break
        log(f"[verify] worker ended (status {rc}); {len(run.todo)} cases left, {time.monotonic() - t0:.0f} s spent")
    return [run.results[i] for i in sorted(run.results)]


def table(results: list[Result]) -> str:
    """One line per group: passes / total, then every case that did not pass."""
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "HANG", "ERROR", "SKIP")}
    lines = [f"== CuTe kernel verification: {len(results)} cases, "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + " =="]
    groups = list(dict.fromkeys(r.group for r in results))
    for g in groups:
        mine = [r for r in results if r.group == g]
        passed = sum(r.status == "PASS" for r in mine)
        verdict = "PASS" if passed == len(mine) else "FAIL" if passed else "BROKEN"
        lines.append(f"{verdict:6s} {g:26s} {passed}/{len(mine)}")
        bad = [r for r in mine if r.status != "PASS"]
        for r in bad[:SHOWN_PER_GROUP]:
            lines.append(f"    {r.status:5s} #{r.index} {r.label}: {r.detail}"[:300])
        if len(bad) > SHOWN_PER_GROUP:
            rest = bad[SHOWN_PER_GROUP:]
            kinds = ", ".join(f"{n} {s}" for s in ("FAIL", "HANG", "ERROR", "SKIP")
                              if (n := sum(r.status == s for r in rest)))
            lines.append(f"    ... {len(rest)} more ({kinds}): " + " ".join(f"#{r.index}" for r in rest))
    return "\n".join(lines)


def passing_groups(results: list[Result]) -> list[str]:
    """Groups whose every case passed (what the benchmark may time)."""
    groups = dict.fromkeys(r.group for r in results)
    return [g for g in groups if all(r.status == "PASS" for r in results if r.group == g)]


def serve(indices: list[int], cases, run_one) -> int:
    """Worker side of the protocol: per case print ``@start i group label``, ``run_one(case)`` →
    ``(STATUS, detail)``, then ``@done i STATUS detail``. An exception ends the worker (status 4):
    after a CUDA error its context is broken, so a fresh worker goes on."""
    for i in indices:
        print(f"@start {i} {cases[i].group} {cases[i].label}", flush=True)
        try:
            status, detail = run_one(cases[i])
        except Exception as exc:
            print(f"@done {i} ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            return 4
        print(f"@done {i} {status} {detail}".rstrip(), flush=True)
    return 0


def worker(indices: list[int]) -> int:
    """Run the given cases in order on this process's GPU; print the protocol lines."""
    from ..gemm import GemmRunner
    from .checks import run_case

    runner = GemmRunner()
    t0 = time.time()
    runner.init()
    print(f"[worker] modules loaded in {time.time() - t0:.2f} s", flush=True)

    def check(case: Case) -> tuple[str, str]:
        result = run_case(runner, case)
        return "PASS" if result.ok else "FAIL", f"err={result.err:.2e} unwritten={result.unwritten} {result.detail}"

    return serve(indices, CASES, check)


def verify(out_dir: Path, budget_s: float, hang_s: float, log=print, kinds: set[str] | None = None,
           groups: set[str] | None = None) -> list[Result]:
    """Run the catalogue (the cases of ``kinds`` and of the kernel ``groups`` only, if given) in
    isolated workers; write verify.json / verify_log.txt; return the results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["OPENINFER_CUTE_HANG_S"] = str(hang_s)
    with open(out_dir / "verify_log.txt", "w") as logf:
        def both(msg: str) -> None:
            logf.write(msg + "\n")
            logf.flush()
            if msg.startswith(("@done", "[")) or msg.startswith("HANG"):
                log(msg)

        results = run_all(CASES, [sys.executable, "-m", "openinfer_kernels.cute.verification.run", "--worker"],
                          budget_s, case_timeout_s=hang_s + 30.0, log=both,
                          only=None if kinds is None and groups is None else
                          {i for i, c in enumerate(CASES) if (kinds is None or c.kind in kinds)
                           and (groups is None or c.group in groups)})
    (out_dir / "verify.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--budget", type=float, default=150.0, help="seconds before the rest is skipped")
    parser.add_argument("--hang-s", type=float, default=6.0, help="seconds after which a launch is a hang")
    parser.add_argument("--worker", metavar="INDICES", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker([int(i) for i in args.worker.split(",") if i])
    results = verify(args.out, args.budget, args.hang_s)
    print(table(results), flush=True)
    return 0 if all(r.status == "PASS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
