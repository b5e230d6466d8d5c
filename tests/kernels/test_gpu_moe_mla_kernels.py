"""The MoE and MLA GPU kernels against the numpy reference ops (engine/executor/cpu_moe_ops.py,
cpu_mla_ops.py), each through the GPU op family method that launches it, on the buffers of a tiny model's
GpuExecutor: router top-k (greedy, renormalized, scaled, group-limited), the device-side expert
grouping (moe_align.cu) against openinfer_kernels/cute/moe.py's layout rules, the grouped GEMM (CuTe and the
wmma fallback), the whole routed-expert op, the MLA cache write, and MLA attention in both forms.

Tolerances: bf16 inputs on both sides; the GPU rounds its outputs (and some intermediates) to bf16,
so values of order 1 agree to ~1e-2 (ROUND), float32 routing weights to 1e-5.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.cpu_moe_ops import route_topk
from engine.executor.cpu_ops import CpuStepContext, NumpyOps
from engine.loader import load_model
from engine.models.ops import RouteSpec
from engine.models.rope import rope_cos_sin
from harness.executors import new_gpu_executor
from harness.models import tiny_model_path

pytestmark = pytest.mark.gpu
ROUND = 2e-2


def bf16(a) -> np.ndarray:
    """float32 values rounded to bf16 (what both sides compute from)."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def dev(a):
    import cupy
    return cupy.asarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


def host(x) -> np.ndarray:
    import cupy
    return cupy.asnumpy(x).view(ml_dtypes.bfloat16).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _executor(name: str, gemm: str):
    """bench/ab_switches.py's executor: the production paths, and the MLA head-group switch one test forces."""
    from bench.ab_switches import ABGpuExecutor

    model = load_model(tiny_model_path(name))
    return model, new_gpu_executor(model, ABGpuExecutor, gemm=gemm, cuda_graphs=False)


def executor(name: str, gemm: str = "auto"):
    """A tiny model's executor, its compute stream made CuPy's current one: the test's uploads, copies and
    reads then queue behind (and in front of) its kernels (that stream does not wait on the null stream)."""
    model, ex = _executor(name, gemm)
    ex.stream.use()
    return model, ex


@pytest.fixture(autouse=True)
def _null_stream_after():
    yield
    import cupy
    cupy.cuda.Stream.null.use()


def test_router_topk_matches_numpy():
    import cupy
    _, ex = executor("deepseek_v2")
    rng = np.random.default_rng(0)
    for spec in (RouteSpec(6, 3, renormalize=True), RouteSpec(6, 2, scale=1.5),
                 RouteSpec(6, 3, num_groups=3, topk_groups=2), RouteSpec(6, 1, num_groups=2, topk_groups=1)):
        x, gate = dev(rng.standard_normal((37, 64))), dev(rng.standard_normal((6, 64)) / 4)
        weights, ids = ex.ops.moe.route(x, gate, spec)
        logits = cupy.asnumpy(ex.ops.moe.buf["moe_logits"][:37 * 6]).reshape(37, 6)
        np.testing.assert_allclose(logits, host(x) @ host(gate).T, rtol=1e-4, atol=1e-4)
        want_w, want_ids = route_topk(logits, spec)
        np.testing.assert_array_equal(cupy.asnumpy(ids), want_ids, err_msg=str(spec))
        np.testing.assert_allclose(cupy.asnumpy(weights), want_w, rtol=1e-5, atol=1e-6, err_msg=str(spec))


@pytest.mark.parametrize("tokens,skew", [(1, False), (5, False), (33, True), (512, False)])
def test_expert_grouping_on_the_device(tokens, skew):
    """Every assignment gets its own row inside its expert's group (groups padded to whole tiles, in
    expert order, as openinfer_kernels/cute/moe.py group_by_expert lays them out), row_token inverts it, padding
    rows are -1, and every tile of the fixed grid names an expert (unused ones the last used)."""
    import cupy

    from openinfer_kernels.cute.moe import group_by_expert
    _, ex = executor("qwen3_moe")
    E, K = 6, 3
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.permutation([0, 1, 2] if skew else E)[:K] for _ in range(tokens)]).astype(np.int32)
    tile_m, rows, row_of, row_token, tile_expert = ex.ops.moe.group_experts(cupy.asarray(ids), E)
    row_of, row_token, tile_expert = (cupy.asnumpy(a) for a in (row_of, row_token, tile_expert))
    ref = group_by_expert(ids, E, tile_m)
    used = ref.tile_expert.size
    np.testing.assert_array_equal(tile_expert[:used], ref.tile_expert)
    assert (tile_expert[used:] == ref.tile_expert[-1]).all() and rows >= ref.padded_rows
    starts = np.concatenate([[0], np.cumsum(-(-ref.counts // tile_m) * tile_m)])
    flat = ids.reshape(-1)
    assert len(set(row_of.tolist())) == flat.size
    assert ((row_of >= starts[flat]) & (row_of < starts[flat] + ref.counts[flat])).all()
    np.testing.assert_array_equal(row_token[row_of], np.arange(flat.size) // K)
    assert (np.delete(row_token, row_of) == -1).all()


@pytest.mark.parametrize("gemm", ["cute", "cublas", "gemv"])
def test_grouped_gemm_matches_numpy(gemm):
    """The CuTe grouped GEMM ("cute"), the mma fallback (no CuTe: "cublas") and the decode-step GEMV
    (moe_gemv.cu: a step of at most GEMV_MAX_TOKENS tokens; here every row of a tile real) on
    expert-grouped rows."""
    import cupy
    _, ex = executor("qwen3_moe", "cublas" if gemm == "gemv" else gemm)
    tokens = 1 if gemm == "gemv" else 1 << 20
    if gemm == "cute" and ex.gemm.cute is None:
        pytest.skip(f"CuTe GEMM not available: {ex.gemm.cute_missing}")
    rng = np.random.default_rng(1)
    for tile_m, tiles, (E, N, K) in ((64, 5, (6, 80, 64)), (128, 3, (4, 136, 200))):
        M = tiles * tile_m
        a, w = rng.standard_normal((M, K)), rng.standard_normal((E, N, K)) / K ** 0.5
        tile_expert = rng.integers(0, E, tiles).astype(np.int32)
        row_token = np.arange(M, dtype=np.int32)
        out = cupy.zeros((M, N), cupy.uint16)
        ex.ops.moe.grouped_linear(dev(a), dev(w), cupy.asarray(tile_expert), cupy.asarray(row_token), out, tile_m, tokens)
        want = np.einsum("mk,mnk->mn", bf16(a), bf16(w)[np.repeat(tile_expert, tile_m)])
        np.testing.assert_allclose(host(out), want, rtol=ROUND, atol=ROUND)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_routed_experts_match_numpy(tokens):
    """route + experts (grouping, gather, grouped gate_up, SiLU·up, grouped down, weighted combine
    into the residual) against NumpyMoEOps on the same bf16 weights."""
    import cupy

    from engine.executor.gpu_gemm import interleave_gate_up
    model, ex = executor("qwen3_moe")
    w = {k: bf16(model.weights[k]) for k in ("layers.1.router", "layers.1.experts_gate_up_proj",
                                             "layers.1.experts_down_proj")}
    rng = np.random.default_rng(tokens)
    x, residual = bf16(rng.standard_normal((tokens, 64))), bf16(rng.standard_normal((tokens, 64)))
    spec = model.model.moe.route
    weights, ids = ex.ops.moe.route(dev(x), dev(w["layers.1.router"]), spec)
    gate_up = w["layers.1.experts_gate_up_proj"]
    interleaved = ex.ops.shared.gate_up_interleaved
    out = ex.ops.moe.experts(dev(x), dev(interleave_gate_up(gate_up) if interleaved else gate_up),
                             dev(w["layers.1.experts_down_proj"]), weights, ids, dev(residual))
    numpy = NumpyOps(np.zeros((1, 1, 16, 1, 8), np.float32), frozenset({"moe"}))
    want = numpy.moe.experts(x, gate_up, w["layers.1.experts_down_proj"], cupy.asnumpy(weights), cupy.asnumpy(ids),
                             residual)
    np.testing.assert_allclose(host(out), want, rtol=ROUND, atol=3 * ROUND)


@pytest.mark.parametrize("tokens", [1, 3, 4])
def test_decode_router_and_ungrouped_experts_equal_the_general_path(tokens):
    """A decode step's one-launch router (moe_route_gemv) picks the ids cuBLAS + moe_topk pick, and its
    experts without the grouping (moe_gemv_silu / moe_gemv_combine) give the bits of the grouped path
    (moe_align, gather, moe_gemv, silu_mul, moe_gemv, combine), launched twice (the router's counter)."""
    import cupy

    model, ex = executor("qwen3_moe")
    ops, spec = ex.ops.moe, model.model.moe.route
    names = ("layers.1.router", "layers.1.experts_gate_up_proj", "layers.1.experts_down_proj")
    router, gate_up, down = (ex.weights[k] for k in names)
    rng = np.random.default_rng(10 + tokens)
    x, residual = dev(rng.standard_normal((tokens, 64))), dev(rng.standard_normal((tokens, 64)))
    results = []
    for fused in (True, False):
        ops.fused_tokens = type(ops).fused_tokens if fused else 0
        ops.route_gemv_tokens = type(ops).route_gemv_tokens if fused else 0
        for _ in range(2):
            weights, ids = ops.route(x, router, spec)
            out = ops.experts(x, gate_up, down, weights, ids, residual.copy())
        results.append((cupy.asnumpy(weights), cupy.asnumpy(ids), cupy.asnumpy(out)))
    ops.fused_tokens, ops.route_gemv_tokens = type(ops).fused_tokens, type(ops).route_gemv_tokens
    (w1, i1, o1), (w0, i0, o0) = results
    np.testing.assert_array_equal(i1, i0)
    np.testing.assert_allclose(w1, w0, rtol=1e-5, atol=1e-6)
    # the same weights: the experts' paths compared on identical routing
    out_fused = cupy.asnumpy(ops.experts(x, gate_up, down, cupy.asarray(w0), cupy.asarray(i0), residual.copy()))
    ops.fused_tokens = 0
    out_grouped = cupy.asnumpy(ops.experts(x, gate_up, down, cupy.asarray(w0), cupy.asarray(i0), residual.copy()))
    ops.fused_tokens = type(ops).fused_tokens
    np.testing.assert_array_equal(out_fused, out_grouped)
    assert np.any(out_fused != cupy.asnumpy(residual))
    assert int(ops.buf["moe_counter"][0].get()) == 0


def mla_step(model, ex):
    """A step of a 20-token prefill (block table [3, 5]) and a decode at position 37 (blocks [0, 1, 2]),
    the decode's earlier cache rows random; (host batch, GPU ctx, CPU ctx, NumpyOps over a float32
    copy of the GPU cache after the writes)."""
    batch = ModelBatch.build([SeqStep(0, list(range(20)), 0, [3, 5], False),
                              SeqStep(1, [7], 37, [0, 1, 2], False)])
    rng = np.random.default_rng(2)
    layer = ex.kv_cache[1, 0]
    layer[:96] = dev(rng.standard_normal((96, 1, layer.shape[-1])))      # blocks 0-5: every row the step reads
    ctx = ex.upload(batch)
    cos, sin = rope_cos_sin(model.config, 64, model.model.rope_dim)
    return batch, ctx, CpuStepContext(batch, cos[batch.positions], sin[batch.positions])


def cpu_ops_over(ex) -> NumpyOps:
    return NumpyOps(host(ex.kv_cache), frozenset({"mla"}))


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2"])
def test_mla_latent_cache_matches_numpy(name):
    model, ex = executor(name)
    spec = model.model.attention_specs[1]
    batch, ctx, cpu_ctx = mla_step(model, ex)
    rng = np.random.default_rng(3)
    y = bf16(rng.standard_normal((batch.num_tokens, spec.q_cols + spec.cache_dim)))
    kv_norm = bf16(1 + 0.2 * rng.standard_normal(spec.kv_lora_rank))
    q_norm = bf16(1 + 0.2 * rng.standard_normal(spec.q_cols)) if model.model.mla.q_lora_rank else None
    q = ex.ops.mla.latent_cache(dev(y), spec, ctx, dev(kv_norm), None if q_norm is None else dev(q_norm))
    ref = cpu_ops_over(ex)
    ref.kv[1, 0, batch.slot_mapping] = 0
    want_q = ref.mla.latent_cache(y, spec, cpu_ctx, kv_norm, q_norm)
    np.testing.assert_allclose(host(q), want_q, rtol=ROUND, atol=ROUND)
    np.testing.assert_allclose(host(ex.kv_cache)[1, 0, batch.slot_mapping], ref.kv[1, 0, batch.slot_mapping],
                               rtol=ROUND, atol=ROUND)


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2"])
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_mla_attention_matches_numpy(name, form):
    """ops.mla.attention over a prefill and a decode sequence: the absorbed form (mla_decode.cu between two
    strided-batched GEMMs; what a decode graph runs) and the expanded one (paged_attention.cu over K and V
    built from the latent), against the numpy reference on the same cache."""
    model, ex = executor(name)
    spec = model.model.attention_specs[1]
    batch, ctx, cpu_ctx = mla_step(model, ex)
    if form == "absorbed":
        ctx.batch = None                 # as in a decode graph: no host batch, no expansion
    rng = np.random.default_rng(4)
    q = bf16(rng.standard_normal((batch.num_tokens, spec.num_heads * spec.qk_dim)))
    kv_b = bf16(model.weights["layers.1.kv_b_proj"])
    o = ex.ops.mla.attention(dev(q), dev(kv_b), spec, ctx)
    assert (ctx.mla not in (None, False)) == (form == "expanded")
    want = cpu_ops_over(ex).mla.attention(q, kv_b, spec, cpu_ctx)
    np.testing.assert_allclose(host(o), want, rtol=ROUND, atol=3 * ROUND)     # o_lat is rounded before W_UV


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2"])
@pytest.mark.parametrize("splits,group", [(1, None), (3, 1), (7, 2), (16, None), (24, 4), (5, 16)])
def test_mla_absorbed_splits_and_head_groups(name, splits, group):
    """mla_decode.cu at forced split counts (empty splits included: 38 keys in splits of 16) and heads per
    CTA, its last split's CTA merging the others in one launch: against numpy, bit-identical run twice,
    every split ticket back at zero."""
    import cupy
    model, ex = executor(name)
    spec = model.model.attention_specs[1]
    batch, ctx, cpu_ctx = mla_step(model, ex)
    ctx.batch, ctx.num_splits = None, splits
    rng = np.random.default_rng(5)
    q = bf16(rng.standard_normal((batch.num_tokens, spec.num_heads * spec.qk_dim)))
    kv_b = bf16(model.weights["layers.1.kv_b_proj"])
    ex.ops.mla.group = group
    try:
        runs = [cupy.asnumpy(ex.ops.mla.attention(dev(q), dev(kv_b), spec, ctx)) for _ in range(2)]
    finally:
        ex.ops.mla.group = None
    np.testing.assert_array_equal(runs[0], runs[1])
    assert int(ex.ops.mla.buf["mla_counters"].sum()) == 0
    want = cpu_ops_over(ex).mla.attention(q, kv_b, spec, cpu_ctx)
    got = runs[0].view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=ROUND, atol=3 * ROUND)


def decode_step(ex, tokens: int):
    """A decode step of `tokens` sequences (sequence i at context 6 + 9·i, blocks 5i .. 5i + 4), uploaded as a
    decode graph sees it (no host batch: the absorbed form): (host batch, ctx, layer 1's cache, its rows read)."""
    batch = ModelBatch.build([SeqStep(i, [7], 5 + 9 * i, list(range(5 * i, 5 * i + 5)), False)
                              for i in range(tokens)])
    ctx = ex.upload(batch)
    ctx.batch = None
    return batch, ctx, ex.kv_cache[1, 0], 16 * 5 * tokens


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_mla_absorb_kernels_match_cublas_and_numpy(name, tokens):
    """mla_absorb.cu's two projections (steps of at most 8 tokens, mla_absorb_tokens) around mla_decode.cu,
    against the same step through the cuBLAS strided-batched pair and against numpy: decode tokens at
    contexts 6 to 69 over random cache rows."""
    model, ex = executor(name)
    spec = model.model.attention_specs[1]
    rng = np.random.default_rng(6)
    batch, ctx, layer, rows = decode_step(ex, tokens)
    layer[:rows] = dev(rng.standard_normal((rows, 1, layer.shape[-1])))
    cos, sin = rope_cos_sin(model.config, 128, model.model.rope_dim)
    cpu_ctx = CpuStepContext(batch, cos[batch.positions], sin[batch.positions])
    q = bf16(rng.standard_normal((tokens, spec.num_heads * spec.qk_dim)))
    kv_b = bf16(model.weights["layers.1.kv_b_proj"])
    outs = []
    for absorb in (0, 8):
        ex.ops.mla.absorb_tokens = absorb
        try:
            outs.append(host(ex.ops.mla.attention(dev(q), dev(kv_b), spec, ctx)))
        finally:
            ex.ops.mla.absorb_tokens = type(ex.ops.mla).absorb_tokens
    np.testing.assert_allclose(outs[1], outs[0], rtol=ROUND, atol=ROUND)
    want = cpu_ops_over(ex).mla.attention(q, kv_b, spec, cpu_ctx)
    np.testing.assert_allclose(outs[1], want, rtol=ROUND, atol=3 * ROUND)


@pytest.mark.parametrize("tokens", [1, 4])
def test_mla_latent_attention_in_one_launch_matches_the_composition(tokens):
    """q_lora_rank unset (deepseek_v2_lite): ops.mla.latent_attention's mla_absorb_q_cache (the latent cache write
    and W_UK's absorption in one launch) against latent_cache + attention on cuBLAS: the same cache
    rows and the attention output within the bf16 rounding."""
    import cupy

    model, ex = executor("deepseek_v2_lite")
    spec = model.model.attention_specs[1]
    rng = np.random.default_rng(8)
    _, ctx, layer, rows = decode_step(ex, tokens)
    start = dev(rng.standard_normal((rows, 1, layer.shape[-1])))
    y = dev(bf16(rng.standard_normal((tokens, spec.q_cols + spec.cache_dim))))
    kv_b = dev(bf16(model.weights["layers.1.kv_b_proj"]))
    kv_norm = dev(bf16(1 + 0.2 * rng.standard_normal(spec.kv_lora_rank)))
    outs = []
    for absorb in (0, 8):
        layer[:rows] = start
        ex.ops.mla.absorb_tokens = absorb
        try:
            o = host(ex.ops.mla.latent_attention(y, kv_b, spec, ctx, kv_norm))
        finally:
            ex.ops.mla.absorb_tokens = type(ex.ops.mla).absorb_tokens
        outs.append((o, cupy.asnumpy(layer[:rows])))
    np.testing.assert_array_equal(outs[1][1], outs[0][1])
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=ROUND, atol=ROUND)
