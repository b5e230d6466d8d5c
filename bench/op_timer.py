"""CUDA-event time of each op of one eager GPU step: GpuOps methods (and its op families' parts', named
"family.op") wrapped for the run, an event pair recorded around every call. Calls inside another wrapped op (norm_linear's inner linear) are kept apart
by nesting depth, so the top-level rows add up to the step and the inner rows split them."""
from __future__ import annotations

from dataclasses import dataclass, field

# GpuOps methods a step's model code calls (outer fused ops and the ops they compose), and its families'
OPS = ("embed", "rms_norm", "linear", "qkv_rope_cache", "attention", "silu_mul", "gather_rows", "add",
       "norm_linear", "add_linear", "add_linear_norm", "norm_swiglu", "rope_attention", "moe.route", "moe.experts",
       "mla.latent_cache", "mla.attention", "mla.latent_attention", "deltanet.causal_conv1d",
       "deltanet.gated_delta_rule", "deltanet.gated_rms_norm", "deltanet.sigmoid_gate",
       "dsv4.hyper_connection", "dsv4.hc_merge", "dsv4.hyper_head", "dsv4.attention", "dsv4.hash_route",
       "dsv4.swiglu_limited", "dsv4.grouped_linear", "dsv4.compress_windows", "dsv4.store_ring",
       "dsv4.indexer_topk", "dsv4.sparse_decode", "dsv4.store_rows")
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


def _targets(ops, names):
    """(object, attribute, name) of each name the served line has: "op" on ops, "family.op" on that part."""
    for name in names:
        family, _, attr = name.rpartition(".")
        owner = vars(ops).get(family) if family else ops
        if owner is not None and hasattr(owner, attr):
            yield owner, attr, name


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

    targets = list(_targets(ops, names))
    own = [(owner, attr, vars(owner).get(attr)) for owner, attr, _ in targets]    # instance attributes to put back
    for owner, attr, name in targets:
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    try:
        run()
        ex.stream.synchronize()
    finally:
        for owner, attr, kept in own:
            if kept is not None:
                setattr(owner, attr, kept)
            else:
                delattr(owner, attr)
    for row in rows.values():
        row.ms = sum(cupy.cuda.get_elapsed_time(a, b) for a, b in row.events)
        row.events = []
    return sorted(rows.values(), key=lambda r: (r.depth, -r.ms))

