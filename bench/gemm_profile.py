"""Launch chosen GEMM configs a few times each, for Nsight Compute to read their counters.

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --csv --page details --log-file DIR/ncu.csv \
        python3 bench/gemm_profile.py 4B.o:512:gemm_bf16_128x128_c1x1 4B.o:512:cublas ...
    python3 bench/gemm_profile.py --parse DIR/ncu.csv
    python3 bench/gemm_profile.py --time 4B.o:512:gemm_bf16_128x128_c1x1 4B.o:512:cublas

Each argument is ``shape:M:variant`` (a Qwen3 projection such as ``4B.o``, or ``NxK``; a CuTe
variant name, or ``cublas`` for torch.mm, the baseline); each runs ``--launches`` times after one
warm-up. ``--parse`` prints one line per kernel launch: duration, DRAM / memory / SM throughput,
L2 and L1 hit rates, and the top warp stalls where the CSV has them. ``--time`` graph-times each spec instead (no ncu).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import QWEN_SHAPES  # noqa: E402

KEYS = {  # ncu metric name (details page) -> column
    "Duration": "us", "DRAM Throughput": "dram%", "L2 Hit Rate": "l2hit%", "Compute (SM) Throughput": "sm%",
    "Memory Throughput": "mem%", "L1/TEX Hit Rate": "l1hit%",
}


def shape_nk(name: str) -> tuple[int, int]:
    """(N, K) of a Qwen3 projection name, or of ``NxK`` (e.g. ``2560x128``: a GEMM's fixed cost)."""
    if name in QWEN_SHAPES:
        return QWEN_SHAPES[name]
    n, k = name.split("x")
    return int(n), int(k)


def time_specs(specs: list[str]) -> None:
    """Graph-replayed µs per launch of each spec (as bench/kernels.py times its rows). Besides
    variant names (``name/S<n>``: n K splits; ``+exact``: A in an allocation of exactly M rows,
    whose tail tiles the TMA zero-fills, instead of a view of a larger buffer; ``+pdl``: weights
    prefetched as below) and ``cublas``:
    ``planned``, ``planned+pdl`` (the weights' first k-tiles loaded before the programmatic-launch
    wait), ``planned+res`` (the residual added in the epilogue, in place) and ``planned+add``
    (the GEMM, then the engine's residual_add kernel)."""
    from bench.kernels import _Operands, cublas_time_us, graph_time_us
    from openinfer_kernels.cute.configs import VARIANTS_BY_NAME, GemmPlan
    from openinfer_kernels.cute.gemm import GemmRunner
    from openinfer_kernels.cute.verification.checks import rand_bf16
    from openinfer_kernels.raw_cuda import kernel
    from openinfer_kernels.raw_cuda.launch import launch

    runner = GemmRunner()
    runner.init()
    add = kernel("add_bias", "residual_add")
    for spec in specs:
        name, m, variant = spec.split(":")
        n, k = shape_nk(name)
        ops = _Operands(runner, int(m), n, k)
        total = int(m) * n // 8
        resid = ops.out.copy()  # the residual stream: +res accumulates into it, +add adds the product to it

        def planned(i, s, mode=variant, ops=ops, resid=resid, total=total):
            if mode == "planned+pdl":  # weights loaded before the PDL wait (a chain of GEMMs)
                runner(ops.a[i], ops.w[i], ops.out, stream=s, prefetch_weights=True)
                return
            if mode == "planned+res":
                runner(ops.a[i], ops.w[i], resid, stream=s, residual=resid)
                return
            runner(ops.a[i], ops.w[i], ops.out, stream=s)
            if mode == "planned+add":
                launch(add, (min(4096, -(-total // 256)),), (256,), (ops.out, resid, resid, total), s)

        if variant == "cublas":
            us = cublas_time_us(int(m), n, k, ops.sets)
        elif variant.startswith("planned"):
            us = graph_time_us(planned, ops.sets, spec)
        else:  # a variant name, "/S<n>" for n K splits; "+exact": A in an allocation of exactly M rows;
            # "+pdl": the weights' first k-tiles loaded before the programmatic-launch wait
            base, *mods = variant.split("+")
            name, _, splits = base.partition("/S")
            plan = GemmPlan(VARIANTS_BY_NAME[name], int(splits or 1))
            if "exact" in mods:  # the TMA zero-fills A's rows past M (slower)
                ops.a = [rand_bf16((int(m), k)) for _ in range(ops.sets)]
            runner(ops.a[0], ops.w[0], ops.out, plan=plan)  # sizes the workspace outside the capture
            us = ops.time_us(plan, spec, prefetch_weights="pdl" in mods)
        print(f"{spec:48} {us:8.1f} µs", flush=True)
        del ops


def run(specs: list[str], launches: int) -> None:
    import cupy as cp

    from openinfer_kernels.cute.configs import VARIANTS_BY_NAME, GemmPlan
    from openinfer_kernels.cute.gemm import GemmRunner
    from openinfer_kernels.cute.verification.checks import rand_bf16

    runner = GemmRunner()
    runner.init()
    for spec in specs:
        name, m, variant = spec.split(":")
        n, k = shape_nk(name)
        m = int(m)
        if variant == "cublas":
            import torch

            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(launches + 1):
                torch.mm(a, w.t())
            torch.cuda.synchronize()
            continue
        a, w = rand_bf16((m, k)), rand_bf16((n, k))
        out = cp.empty((m, n), dtype=cp.uint16)
        runner.reserve_workspace(m, [(n, k)])
        for _ in range(launches + 1):
            runner(a, w, out, plan=GemmPlan(VARIANTS_BY_NAME[variant]))
        cp.cuda.Device().synchronize()
        print(f"ran {spec}", flush=True)


def parse(path: str) -> None:
    rows: dict[str, dict] = {}
    order = []
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    for r in csv.DictReader(lines):
        key = (r["ID"], r["Kernel Name"][:60])
        if key not in rows:
            rows[key] = {}
            order.append(key)
        rows[key][f'{r["Section Name"]}/{r["Metric Name"]}'] = f'{r["Metric Value"]} {r["Metric Unit"]}'
    for key in order:
        metrics = rows[key]
        picked = {col: v for name, col in KEYS.items() for mk, v in metrics.items() if mk.endswith("/" + name)}
        stalls = sorted(((float(v.split()[0].replace(",", "")), mk.split("/")[-1]) for mk, v in metrics.items()
                         if mk.startswith("WarpStateStats/") and "Stall" in mk and v.split()[0].replace(".", "").replace(",", "").isdigit()),
                        reverse=True)[:3]
        print(f"{key[0]:>4} {key[1]:60} " + " ".join(f"{c}={v}" for c, v in picked.items())
              + " | " + ", ".join(f"{s}={v:.1f}" for v, s in stalls))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("specs", nargs="*")
    p.add_argument("--launches", type=int, default=2)
    p.add_argument("--parse", metavar="NCU_CSV")
    p.add_argument("--time", action="store_true", help="time each spec (graph replay) instead")
    args = p.parse_args()
    if args.parse:
        parse(args.parse)
    elif args.time:
        time_specs(args.specs)
    else:
        run(args.specs, args.launches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
