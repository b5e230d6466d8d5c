"""CuTe kernels on the GPU: isolated verification of every kernel, then speed against cuBLAS.

    python3 bench/kernels.py [--out DIR] [--budget 210] [--verify-budget 100] [--hang-s 6] [--no-sweep]
                             [--attention-only] [--only-variants A,B --shapes 4B.o,8B.qkv --ms 512,2048]

1. Verification (``openinfer_kernels.cute.verification.run``): every case of ``openinfer_kernels.cute.verification.checks.CASES`` (fresh
   random bf16, NaN-poisoned output, float32 reference, rel. error ≤ 1e-2, every element written)
   in worker processes with a hang watchdog; a hang or crash costs one case, not the run.
2. Benchmark, in worker processes too, of the kernels that passed: Qwen3-4B/8B projection shapes
   for M ∈ {1, 8, 32, 128, 512, 2048, 8192}, the planned config against cuBLAS bf16 (torch.mm, the
   baseline only), each timing a CUDA graph of 20 launches over rotating weight copies (> L2),
   median of 5 replays, with A a view of a buffer of whole 256-row tiles as in the engine; causal attention TFLOP/s at 1k / 4k / 16k tokens (against torch SDPA), a
   batch of 8 sequences and 512 new tokens on a cached prefix, for every verified attention kernel;
   then (unless ``--no-sweep``, and while the budget lasts) every variant / split count per shape,
   which is how ``configs.plan_gemm`` is tuned.
``--only-variants`` verifies just those GEMM variants (new tile configs) and takes the other GEMM
variants as verified by earlier runs (said in the summary), with no attention rows; ``--shapes`` and
``--ms`` narrow the GEMM rows and the sweep. The parent process never touches the GPU. Tables are printed last; ``summary.md``,
``verify.json``, ``verify_log.txt``, ``bench_log.txt`` and ``bench.json`` are written to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openinfer_kernels.cute.attention import ATTENTION_KERNELS  # noqa: E402
from openinfer_kernels.cute.configs import (GEMM_VARIANTS, MAX_SPLITS, GemmPlan, plan_gemm, split_count,  # noqa: E402
                                  takes_weight_prefetch)
from openinfer_kernels.cute.gemm import A_ROW_PAD  # noqa: E402
from openinfer_kernels.cute.verification.checks import Case  # noqa: E402
from openinfer_kernels.cute.verification.run import passing_groups, run_all, serve, table, verify  # noqa: E402

QWEN_SHAPES = {  # name: (N, K)
    "4B.qkv": (6144, 2560), "4B.o": (2560, 4096), "4B.gate_up": (19456, 2560), "4B.down": (2560, 9728),
    "8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (24576, 4096), "8B.down": (4096, 12288),
}
MS = (1, 8, 32, 128, 512, 2048, 8192)
MIX = (2048, 1024, 1000, 512, 300, 130, 64, 17)
ATTN_ROWS = {  # label: (query lengths, key lengths); SDPA baseline on the single full sequences only
    "1k": ((1024,), (1024,)), "4k": ((4096,), (4096,)), "16k": ((16384,), (16384,)),
    "8 seqs, 5.1k": (MIX, MIX), "512 on 3.5k cached": ((512,), (4096,))}
GRAPH_LAUNCHES = 20
ROTATE_BYTES = 256 << 20


# ---- tasks (built in the parent, run in a worker) ----------------------------------------------
def bench_tasks(ok: set[str], sweep: bool, gemm: bool = True, shapes: tuple[str, ...] = tuple(QWEN_SHAPES),
                ms: tuple[int, ...] = MS) -> tuple[Case, ...]:
    """The benchmark rows to run, given the kernel groups that passed verification."""
    tasks = [Case("hbm", "device copy bandwidth", "hbm", ())]
    for kernel in ATTENTION_KERNELS:
        if kernel in ok:
            tasks += [Case(f"{kernel} {label}", f"{kernel} {label}", "attention", (label, kernel)) for label in ATTN_ROWS]
    if not gemm:
        return tuple(tasks)
    for name in shapes:
        n, k = QWEN_SHAPES[name]
        for m in ms:
            plan = plan_gemm(m, n, k)
            if plan.variant.name in ok:
                tasks.append(Case(f"gemm {name} M={m}", f"{name} M={m}", "gemm", (name, m)))
    if sweep and any(v.name in ok for v in GEMM_VARIANTS):
        for name in shapes:
            for m in ms:
                tasks.append(Case(f"sweep {name} M={m}", f"sweep {name} M={m}", "sweep", (name, m, sorted(ok))))
    return tuple(tasks)


def graph_time_us(launch, sets: int, what: str) -> float:
    """Median µs per launch over replays of a CUDA graph holding GRAPH_LAUNCHES launches."""
    import cupy as cp

    from openinfer_kernels.cute.verification.checks import HANG_SECONDS, sync_or_die

    hang_s = max(HANG_SECONDS, 20.0)  # a graph of 20 launches of a slow kernel is no hang
    # the inputs were made on the legacy default stream, which the non-blocking timed stream does not
    # wait for (likely why the 2026-11-30 run's small-M plan rows read up to 3.7x the sweep's same config)
    sync_or_die(f"{what}: making its inputs", cp.cuda.Stream.null, hang_s)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(2):
            launch(i % sets, stream)
        sync_or_die(what, stream, hang_s)
        stream.begin_capture()
        try:
            for i in range(GRAPH_LAUNCHES):
                launch(i % sets, stream)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        sync_or_die(what, stream, hang_s)
        times = []
        for _ in range(5):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            sync_or_die(what, stream, hang_s)
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / GRAPH_LAUNCHES)
    return sorted(times)[len(times) // 2]


def cublas_time_us(m: int, n: int, k: int, sets: int) -> float:
    """cuBLAS bf16 through torch (baseline only), graph-replayed like ours."""
    import torch

    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    us = torch_graph_us(lambda i: torch.mm(a[i % sets], w[i % sets].t(), out=out))
    a = w = out = None  # freed before the cache is emptied
    torch.cuda.empty_cache()
    return us


def torch_graph_us(step) -> float:
    """Median µs per ``step(i)`` (torch work) over replays of a CUDA graph of GRAPH_LAUNCHES steps."""
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for i in range(3):
            step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_LAUNCHES):
            step(i)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_LAUNCHES)
    del graph
    return sorted(times)[len(times) // 2]


class _Operands:
    """Rotating weight/activation copies (together > L2) for one GEMM shape."""

    def __init__(self, runner, m: int, n: int, k: int):
        import cupy as cp

        from openinfer_kernels.cute.verification.checks import rand_bf16

        self.sets = max(2, min(16, math.ceil(ROTATE_BYTES / (n * k * 2))))
        # A as the engine holds it: a view of a larger buffer (its arena), so the launcher reads
        # whole tiles past M rather than TMA's slower zero fill (openinfer_kernels.cute.gemm.readable_rows)
        rows = -(-m // A_ROW_PAD) * A_ROW_PAD
        self.a = [rand_bf16((rows, k))[:m] for _ in range(self.sets)]
        self.w = [rand_bf16((n, k)) for _ in range(self.sets)]
        self.out = cp.empty((m, n), dtype=cp.uint16)
        self.runner = runner
        runner.reserve_workspace(m, [(n, k)])

    def time_us(self, plan: GemmPlan, what: str, prefetch_weights: bool = False) -> float:
        return graph_time_us(lambda i, s: self.runner(self.a[i], self.w[i], self.out, stream=s, plan=plan,
                                                      prefetch_weights=prefetch_weights), self.sets, what)


def write_report(out: Path, name: str, lines: list[str]) -> None:
    """Write a report's lines to ``out/name`` and print them."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth of 1 GiB (read + write), GB/s."""
    import cupy as cp

    src = cp.empty(1 << 30, dtype=cp.uint8)
    dst = cp.empty_like(src)
    dst[...] = src
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        dst[...] = src
    end.record()
    end.synchronize()
    return 2 * src.nbytes * 10 / (cp.cuda.get_elapsed_time(start, end) * 1e-3) / 1e9


def run_task(runner, task: Case) -> dict:
    import cupy as cp

    if task.kind == "hbm":
        return {"hbm_gbs": copy_bandwidth_gbs()}
    if task.kind == "attention":
        return attention_row(runner, *task.args)
    name, m = task.args[:2]
    n, k = QWEN_SHAPES[name]
    ops = _Operands(runner, m, n, k)
    try:
        if task.kind == "gemm":
            plan = plan_gemm(m, n, k)
            what = f"{plan.variant.name} M={m} N={n} K={k}"
            cute_us = ops.time_us(plan, what)
            # as the engine launches it: a stream's first weight tiles load before its wait (the
            # launcher ignores the flag elsewhere, so the plain time stands for it there)
            prefetch_us = (ops.time_us(plan, what + " +prefetch", prefetch_weights=True)
                           if takes_weight_prefetch(plan.variant, m) else cute_us)
            return {"name": name, "m": m, "n": n, "k": k, "plan": f"{plan.variant.name}/S{plan.splits}",
                    "cute_us": cute_us, "prefetch_us": prefetch_us, "cublas_us": cublas_time_us(m, n, k, ops.sets)}
        ok = set(task.args[2])
        trials = {}
        for v in GEMM_VARIANTS:
            if v.grouped or v.residual or v.name not in ok:  # residual twins: timed by gemm_profile --time
                continue
            if v.out == "bf16" and not (m > 256 and v.tile_m == 64):
                trials[f"{v.name}/S1"] = GemmPlan(v, 1)
            elif v.out == "f32" and m <= 256:
                for s in sorted({split_count(k, s) for s in range(2, MAX_SPLITS + 1)}):
                    trials[f"{v.name}/S{s}"] = GemmPlan(v, s)
        sweep = {key: ops.time_us(p, f"{key} M={m} N={n} K={k}") for key, p in trials.items()}
        best = min(sweep, key=sweep.get) if sweep else None
        return {"name": name, "m": m, "sweep": sweep, "best": best, "best_us": sweep.get(best)}
    finally:
        del ops
        cp.get_default_memory_pool().free_all_blocks()


def attention_row(runner, label: str, kernel: str) -> dict:
    """Causal attention of ``ATTN_ROWS[label]``, Qwen3-8B heads (32 q / 8 kv), ours vs torch SDPA."""
    import cupy as cp
    import numpy as np

    from openinfer_kernels.cute.attention import ATTENTION_BY_NAME, attention_work, varlen_attention
    from openinfer_kernels.cute.verification.checks import rand_bf16

    lengths_q, lengths_k = ATTN_ROWS[label]
    hq, hkv, d = 32, 8, ATTENTION_BY_NAME[kernel].head_dim
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q, o = rand_bf16((int(cu_q[-1]), hq, d)), cp.empty((int(cu_q[-1]), hq, d), cp.uint16)
    k, v = rand_bf16((int(cu_k[-1]), hkv, d)), rand_bf16((int(cu_k[-1]), hkv, d))
    cu_qd, cu_kd, work = cp.asarray(cu_q), cp.asarray(cu_k), cp.asarray(attention_work(cu_q))
    # QK and PV over the visible keys: query i of a sequence sees i + (len_k - len_q) + 1 keys
    flops = 4 * d * hq * sum(lq * (lk - lq) + lq * (lq + 1) / 2 for lq, lk in zip(lengths_q, lengths_k))
    ours = graph_time_us(lambda i, s: varlen_attention(runner, q, k, v, o, cu_qd, cu_kd, work, s, kernel), 1,
                         f"{kernel} {label}")
    sdpa = float("nan")
    if len(lengths_q) == 1 and lengths_q == lengths_k:
        try:
            sdpa = sdpa_time_us(lengths_q[0], hq, hkv, d)
        except Exception as exc:  # baseline only
            print(f"torch SDPA baseline failed: {exc}", flush=True)
    return {"kernel": kernel, "head_dim": d, "label": label, "ours_us": ours, "ours_tflops": flops / ours / 1e6,
            "sdpa_us": sdpa, "sdpa_tflops": flops / sdpa / 1e6}


def sdpa_time_us(n: int, hq: int, hkv: int, d: int) -> float:
    """torch ``scaled_dot_product_attention`` (causal, GQA) on one sequence: µs per call over 10."""
    import torch

    tq = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    tk, tv = (torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    attn = torch.nn.functional.scaled_dot_product_attention
    for _ in range(3):
        attn(tq, tk, tv, is_causal=True, enable_gqa=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        attn(tq, tk, tv, is_causal=True, enable_gqa=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / 10


def worker(indices: list[int], ok: list[str], sweep: bool, gemm: bool, shapes: tuple[str, ...],
           ms: tuple[int, ...]) -> int:
    from openinfer_kernels.cute.gemm import GemmRunner

    tasks = bench_tasks(set(ok), sweep, gemm, shapes, ms)
    runner = GemmRunner()
    runner.init()
    return serve(indices, tasks, lambda task: ("PASS", json.dumps(run_task(runner, task))))


# ---- tables -------------------------------------------------------------------------------------
def _short(plan: str) -> str:
    return plan.replace("gemm_", "")


def gemm_table(rows: list[dict], hbm: float, sweeps: dict) -> str:
    """Planned config vs cuBLAS per shape, with the sweep's best config where it ran. ``µs``: a
    chain of the planned GEMM (programmatic launches); ``prefetched``: the same with
    ``prefetch_weights``, as the engine launches it (the plain time where the plan does not take
    it), which the ratio, rates and %HBM are of."""
    lines = ["| shape | M | plan | µs | prefetched µs | cuBLAS µs | cuBLAS/ours | TFLOP/s | GB/s | %HBM | sweep best µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, n, k = r["m"], r["n"], r["k"]
        us = r.get("prefetch_us", r["cute_us"])
        t = us * 1e-6
        flops, nbytes = 2 * m * n * k, 2 * (m * k + n * k + m * n)
        best = sweeps.get((r["name"], m))
        best = f"{_short(best['best'])} {best['best_us']:.1f}" if best and best["best"] else ""
        lines.append(f"| {r['name']} | {m} | {_short(r['plan'])} | {r['cute_us']:.1f} | {us:.1f} | "
                     f"{r['cublas_us']:.1f} | {r['cublas_us'] / us:.2f} | {flops / t / 1e12:.0f} | "
                     f"{nbytes / t / 1e9:.0f} | {100 * nbytes / t / 1e9 / hbm:.0f} | {best} |")
    return "\n".join(lines)


def attention_table(rows: list[dict]) -> str:
    lines = ["| causal attention, 32/8 heads | kernel | head dim | ours µs | ours TFLOP/s | SDPA µs | SDPA TFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['kernel']} | {r['head_dim']} | {r['ours_us']:.0f} | {r['ours_tflops']:.0f} | "
              f"{r['sdpa_us']:.0f} | {r['sdpa_tflops']:.0f} |" for r in rows]
    return "\n".join(lines)


def gpu_info() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--budget", type=float, default=210.0, help="seconds for the whole run")
    parser.add_argument("--verify-budget", type=float, default=100.0)
    parser.add_argument("--hang-s", type=float, default=6.0)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--attention-only", action="store_true",
                        help="verify and time the attention kernels only (no GEMM cases, rows or sweep)")
    parser.add_argument("--only-variants", default="",
                        help="verify only these GEMM variants (comma-separated; 'planned' / 'padded' / 'graph' / 'residual': the planned path)")
    parser.add_argument("--shapes", default=",".join(QWEN_SHAPES), help="GEMM rows / sweep: these projections")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="GEMM rows / sweep: these M")
    parser.add_argument("--worker", metavar="INDICES", help=argparse.SUPPRESS)
    parser.add_argument("--ok", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = tuple(x for x in args.shapes.split(",") if x)
    unknown = [x for x in shapes if x not in QWEN_SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(QWEN_SHAPES)}")
    ms = tuple(int(x) for x in args.ms.split(",") if x)
    focus = {x for x in args.only_variants.split(",") if x}
    known = {v.name for v in GEMM_VARIANTS} | {"planned", "padded", "prefetch", "graph", "residual"}  # the planned path's cases
    if focus - known:
        parser.error(f"unknown variants {sorted(focus - known)}; known: {', '.join(sorted(known))}")
    if args.worker is not None:
        return worker([int(i) for i in args.worker.split(",") if i], args.ok.split(","), not args.no_sweep,
                      not args.attention_only, shapes, ms)

    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    info = f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {gpu_info()}"
    print(info, flush=True)
    results = verify(args.out, args.verify_budget, args.hang_s, kinds={"attention"} if args.attention_only else None,
                     groups=focus or None)
    ok = passing_groups(results)
    if focus:                               # the other GEMM variants passed in earlier runs
        assumed = sorted(v.name for v in GEMM_VARIANTS if v.name not in focus)
        ok = sorted(set(ok) | set(assumed))
        info += f"; verified now: {', '.join(sorted(focus))}; taken as verified earlier: {', '.join(assumed)}"
    tasks = bench_tasks(set(ok), not args.no_sweep, not args.attention_only, shapes, ms)
    cmd = [sys.executable, os.path.abspath(__file__), "--ok", ",".join(ok), "--shapes", ",".join(shapes),
           "--ms", ",".join(map(str, ms))] + (["--no-sweep"] if args.no_sweep else []) \
        + (["--attention-only"] if args.attention_only else [])
    os.environ["OPENINFER_CUTE_HANG_S"] = str(args.hang_s)
    with open(args.out / "bench_log.txt", "w") as logf:
        def log(msg):
            logf.write(msg + "\n")
            logf.flush()
            if msg.startswith(("@done", "[verify]", "HANG")):
                print(msg[:200], flush=True)

        bench = run_all(tasks, cmd + ["--worker"], max(args.budget - (time.monotonic() - t0), 0.0),
                        case_timeout_s=args.hang_s + 60.0, log=log)
    rows = {kind: [json.loads(r.detail) for r in bench if r.status == "PASS" and tasks[r.index].kind == kind]
            for kind in ("hbm", "gemm", "attention", "sweep")}
    (args.out / "bench.json").write_text(json.dumps({"info": info, "ok": ok, **rows}, indent=1))
    hbm = rows["hbm"][0]["hbm_gbs"] if rows["hbm"] else float("nan")
    sweeps = {(r["name"], r["m"]): r for r in rows["sweep"]}
    lost = [f"{r.status} {r.label}: {r.detail}" for r in bench if r.status != "PASS"]
    summary = "\n\n".join([
        f"# CuTe kernels: {info}", table(results),
        f"device copy bandwidth {hbm:.0f} GB/s (read + write); {len(rows['sweep'])} shapes swept; "
        f"benchmark rows not run: {len(lost)}" + "".join(f"\n    {x}"[:160] for x in lost[:6]),
        gemm_table(rows["gemm"], hbm, sweeps) if rows["gemm"] else "(no GEMM rows)", attention_table(rows["attention"]),
        f"total {time.monotonic() - t0:.0f} s"])
    (args.out / "summary.md").write_text(summary + "\n")
    print("\n" + summary, flush=True)
    return 0 if all(r.status == "PASS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
