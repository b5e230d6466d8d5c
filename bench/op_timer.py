"""CUDA-event time of each op of one eager GPU step: GpuOps methods wrapped for the run, an event pair
recorded around every call. Calls inside another wrapped op (norm_linear's inner linear) are kept apart
by nesting depth, so the top-level rows add up to the step and the inner rows split them."""
from __future__ import annotations

from dataclasses import dataclass, field

# GpuOps methods a step's model code calls (outer fused ops and the ops they compose)
OPS = ("embed", "rms_norm", "linear", "qkv_rope_cache", "attention", "silu_mul", "gather_rows", "add",
       "norm_linear", "add_linear", "add_linear_norm", "norm_swiglu", "rope_attention", "route", "moe_experts",
       "mla_latent_cache", "mla_attention", "causal_conv1d", "gated_delta_rule", "gated_rms_norm",
       "sigmoid_gate")
# the weight argument of the ops that multiply by one (its bytes: the op's read roofline and its FLOPs)
WEIGHT_ARG = {"linear": 1, "add_linear": 1, "add_linear_norm": 1, "norm_linear": 3, "norm_swiglu": 3}


@dataclass
class OpTime:
    op: str                  # "name" or "name.weight" (the weight's last name part)
    depth: int               # 0: called by the model code; 1+: inside another timed op
    calls: int = 0
    ms: float = 0.0
    weight_bytes: int = 0
    flops: float = 0.0       # 2·rows·weight elements for a product, else 0
    events: list = field(default_factory=list, repr=False)


def time_ops(ex, run, names=OPS) -> list[OpTime]:
    """Run ``run()`` (one eager step on ``ex``) with ``names`` of ex.ops timed; the rows, slowest first."""
    import cupy

    ops, depth = ex.ops, [0]
    weight_names = {id(v): k for k, v in ex.weights.items()}
    rows: dict[tuple[str, int], OpTime] = {}

    def wrap(name, fn):
        def timed(*a, **kw):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(ex.stream)
            depth[0] += 1
            try:
                out = fn(*a, **kw)
            finally:
                depth[0] -= 1
            e1.record(ex.stream)
            label, nbytes, flops = name, 0, 0.0
            if name in WEIGHT_ARG and len(a) > WEIGHT_ARG[name]:
                w = a[WEIGHT_ARG[name]]
                label = f"{name}." + weight_names.get(id(w), "?").split(".")[-1]
                nbytes, flops = int(w.nbytes), 2.0 * a[0].shape[0] * w.size
            row = rows.setdefault((label, depth[0]), OpTime(label, depth[0]))
            row.calls += 1
            row.weight_bytes += nbytes
            row.flops += flops
            row.events.append((e0, e1))
            return out
        return timed

    saved = {n: getattr(ops, n) for n in names if hasattr(ops, n)}
    own = {n: vars(ops)[n] for n in saved if n in vars(ops)}      # instance attributes to put back
    for n, f in saved.items():
        setattr(ops, n, wrap(n, f))
    try:
        run()
        ex.stream.synchronize()
    finally:
        for n in saved:
            if n in own:
                setattr(ops, n, own[n])
            else:
                delattr(ops, n)
    for row in rows.values():
        row.ms = sum(cupy.cuda.get_elapsed_time(a, b) for a, b in row.events)
        row.events = []
    return sorted(rows.values(), key=lambda r: (r.depth, -r.ms))

