"""GPU check shared by the tests and the benchmark: one GEMM against a float32 reference (needs CuPy)."""
from __future__ import annotations

from .bf16 import from_bf16, to_bf16
from .configs import GemmPlan

NAN_BF16 = 0x7FC0


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
    cp.cuda.runtime.deviceSynchronize()
    got = from_bf16(out)
    ref = from_bf16(a) @ from_bf16(b).T
    unwritten = int(cp.isnan(got).sum())
    err = float(cp.linalg.norm(cp.nan_to_num(got - ref, nan=1e30)) / cp.linalg.norm(ref))
    return err, unwritten
