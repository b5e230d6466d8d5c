"""A prefill-sized gate_up product with its SiLU·up: cuBLAS + silu_mul.cu (the engine's path above the
CuTe rows) against the CuTe GEMM's SiLU·up twins (one kernel, half the output bytes), graph-replayed.

    python3 bench/swiglu_gemm.py [--ms 256,512,1024,...] [--shapes 4B.gate_up,8B.gate_up] [--out DIR]

Per (shape, M): µs of ``cublas+silu`` (engine.executor.gpu_gemm.Gemm on cuBLAS, then silu_mul.cu in its
interleaved mode), ``planned+silu`` (the CuTe plan, then silu_mul.cu), and each CuTe tile with a SiLU·up
twin (``swiglu:<tile>``), each twin's output checked against ``cublas+silu`` (max |Δ| over the largest
|value|, in bf16 ulps of that scale). The rows feed ``configs.SWIGLU_TILES`` (the tile the engine's
prefill-sized SiLU·up products take).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import QWEN_SHAPES, graph_time_us  # noqa: E402

CANDIDATES = ("gemm_bf16_128x256_c2x1", "gemm_bf16_128x256_c1x1", "gemm_bf16_128x192_c2x1",
              "gemm_bf16_128x192_c1x1", "gemm_bf16_128x160_c1x2", "gemm_bf16_128x128_c2x1")


def bf16_to_f32(x):
    import cupy as cp
    return (x.astype(cp.uint32) << 16).view(cp.float32)


def run(ms: list[int], shapes: list[str]) -> list[dict]:
    import cupy as cp

    from engine.executor.gpu_gemm import Gemm, interleave_gate_up
    from openinfer_kernels.cute.configs import VARIANTS_BY_NAME, GemmPlan, plan_gemm
    from openinfer_kernels.cute.gemm import GemmRunner
    from openinfer_kernels.cute.verification.checks import rand_bf16
    from openinfer_kernels.raw_cuda import kernel
    from openinfer_kernels.raw_cuda.launch import launch

    runner = GemmRunner()
    runner.init()
    silu = kernel("silu_mul", "silu_mul")
    gemms: dict[int, Gemm] = {}
    rows = []
    for name in shapes:
        n, k = QWEN_SHAPES[name]
        sets = max(2, min(8, (256 << 20) // (n * k * 2)))
        ws = [cp.asarray(interleave_gate_up(cp.asnumpy(rand_bf16((n, k))))) for _ in range(sets)]
        for m in ms:
            pad = -(-m // 256) * 256
            xs = [rand_bf16((pad, k))[:m] for _ in range(sets)]
            gate_up = cp.empty((m, n), cp.uint16)
            out = cp.empty((m, n // 2), cp.uint16)
            total = m * (n // 2) // 8
            row = {"shape": name, "m": m, "plan": plan_gemm(m, n, k).variant.name}

            def act(s):
                launch(silu, (max(1, min(4096, -(-total // 256))),), (256,),
                       (gate_up, out, cp.int32(n // 2), cp.int64(total), cp.int32(1)), s)

            def cublas_silu(i, s):
                if s.ptr not in gemms:       # a handle bound to the timing stream, as the engine binds its own
                    gemms[s.ptr] = Gemm(s, cp.empty(32 << 20, cp.uint8), num_sms=132)
                gemms[s.ptr](xs[i], ws[i], gate_up)
                act(s)

            def planned_silu(i, s):
                runner(xs[i], ws[i], gate_up, stream=s)
                act(s)

            row["cublas+silu"] = graph_time_us(cublas_silu, sets, f"{name}:{m}:cublas+silu")
            ref = bf16_to_f32(out).copy()
            row["planned+silu"] = graph_time_us(planned_silu, sets, f"{name}:{m}:planned+silu")
            scale = float(cp.abs(ref).max()) or 1.0
            for tile in CANDIDATES:
                plan = GemmPlan(VARIANTS_BY_NAME[tile + "_ws"] if tile + "_ws" in VARIANTS_BY_NAME
                                else VARIANTS_BY_NAME[tile])

                def twin(i, s, plan=plan):
                    if not runner.swiglu(xs[i], ws[i], out, stream=s, plan=plan):
                        raise RuntimeError(f"{plan.variant.name}: no SiLU·up twin")

                us = graph_time_us(twin, sets, f"{name}:{m}:swiglu:{tile}")
                err = float(cp.abs(bf16_to_f32(out) - ref).max()) / scale * 256   # in bf16 ulps of the scale
                row[f"swiglu:{tile}"] = us
                row[f"ulps:{tile}"] = round(err, 3)
            best = min((t for t in CANDIDATES), key=lambda t: row[f"swiglu:{t}"])
            row["best"] = best
            print(json.dumps(row), flush=True)
            rows.append(row)
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def table(rows: list[dict]) -> str:
    head = ["shape", "M", "cuBLAS + silu_mul", "CuTe plan + silu_mul"] + [t.removeprefix("gemm_bf16_") for t in CANDIDATES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], str(r["m"]), f"{r['cublas+silu']:.1f}", f"{r['planned+silu']:.1f}"]
        cells += [("**%.1f**" if t == r["best"] else "%.1f") % r[f"swiglu:{t}"] for t in CANDIDATES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="256,512,768,1024,1144,1536,2048,4096,8192")
    p.add_argument("--shapes", default="4B.gate_up,8B.gate_up")
    p.add_argument("--out", default="")
    a = p.parse_args()
    rows = run([int(m) for m in a.ms.split(",")], a.shapes.split(","))
    print(table(rows))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "swiglu_gemm.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
