"""GPU gate of LoRA (gpu_lora_ops.py: lora_shrink.cu, lora_expand.cu) by the DESIGN.md floor method of
test_gpu_executor: tiny Qwen3 and Llama with the three PEFT adapters of harness/lora.py, transformers +
peft float32 the oracle, the same in bf16 (adapters in bf16) the floor, each adapter through prefill,
decode and chunked steps and on each GEMM library. Then the paths that are LoRA's own: the kernels
against the numpy reference (random token -> slot maps with rows of no adapter, every site shape, token
counts across the tiles), a batch mixing every adapter and the base model against each alone, CUDA-graph
decode with adapters against eager in buckets straddling their boundaries (base steps still on the base
graphs), batch 1 twice bit-identical, a slot reloaded with another adapter, and the engine serving more
adapters than slots.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.loader import load_model
from engine.lora import load_adapter, lora_sites
from harness.executors import new_gpu_executor
from harness.lora import TINY_ADAPTERS, peft_model, tiny_adapter_path
from harness.models import engine_logits, log_softmax, random_sequences, tiny_model_path
from test_gpu_executor import MIN_TIE_TOL, PATHS, assert_gate, assert_same_or_tie, gate_row, greedy, hf_run
from test_gpu_moe_mla import assert_same_scores

pytestmark = pytest.mark.gpu
MODELS = ["qwen3_tied", "llama"]
ADAPTERS = sorted(TINY_ADAPTERS)


def adapters_of(name: str, ex) -> dict:
    sites, layers = lora_sites(ex.model), ex.config.num_hidden_layers
    return {a: load_adapter(a, tiny_adapter_path(name, a), sites, layers, 16) for a in ADAPTERS}


def lora_gpu_executor(name: str, model, max_loras: int = 3, fused: bool = True, **settings):
    """fused: steps of at most FUSED_MAX_ROWS rows take the extended product at every site (the tiny models'
    sites are too narrow for the default FUSED_MAX_EXTRA); False: lora_shrink + lora_expand."""
    from engine.executor import gpu_lora_layout as layout

    kept = layout.FUSED_MAX_EXTRA
    layout.FUSED_MAX_EXTRA = 1e9 if fused else -1.0
    try:
        ex = new_gpu_executor(model, max_loras=max_loras, max_lora_rank=16, **settings)
    finally:
        layout.FUSED_MAX_EXTRA = kept
    for slot, adapter in enumerate(list(adapters_of(name, ex).values())[:max_loras]):
        ex.set_lora(slot, adapter)
    return ex


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    """(name, model, executor with the adapters in slots 0..2, sequences, {adapter: (o32, o16)})."""
    import torch

    name = request.param
    path = tiny_model_path(name)
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=1)
    oracle = {}
    for a in ADAPTERS:
        m32, m16 = (peft_model(path, tiny_adapter_path(name, a), dtype, "cuda") for dtype in ("float32", "bfloat16"))
        oracle[a] = ([hf_run(m32, s) for s in seqs], [hf_run(m16, s) for s in seqs])
        del m32, m16
        torch.cuda.empty_cache()
    ex = lora_gpu_executor(name, model)
    yield name, model, ex, seqs, oracle
    ex.close()


@pytest.mark.parametrize("path_name", sorted(PATHS))
def test_lora_gate(tiny, path_name):
    name, _, ex, seqs, oracle = tiny
    for slot, a in enumerate(ADAPTERS):
        engine = engine_logits(ex, seqs, lora_slots=[slot] * len(seqs), **PATHS[path_name])
        assert_gate(gate_row(f"{name}/lora-{a}/{path_name}", engine, *oracle[a]))


@pytest.mark.parametrize("mode", ["extended", "shrink"])
@pytest.mark.parametrize("backend", ["cute", "cublas"])
def test_lora_gate_gemm_library(tiny, backend, mode):
    """Each GEMM library for every product, and batch-1 decode (gemv.cu), small steps through the extended
    products (the delta in the kernel after it) or through lora_shrink + lora_expand."""
    from openinfer_kernels.cute import available

    if backend == "cute" and not available():
        pytest.skip(f"CuTe kernels unavailable: {available().reason}")
    name, model, _, seqs, oracle = tiny
    ex = lora_gpu_executor(name, model, fused=mode != "shrink", gemm=backend)
    try:
        for slot, a in enumerate(ADAPTERS):
            engine = engine_logits(ex, seqs, lora_slots=[slot] * len(seqs), **PATHS["decode"])
            assert_gate(gate_row(f"{name}/lora-{a}/{backend}/decode", engine, *oracle[a]))
            one = engine_logits(ex, seqs[:1], lora_slots=[slot], prefill=20, chunks=1)
            assert_gate(gate_row(f"{name}/lora-{a}/{backend}/batch1", one, [oracle[a][0][0]], [oracle[a][1][0]]))
    finally:
        ex.close()


def test_qkv_delta_in_attention(tiny):
    """The default: decode steps add the q/k/v delta in paged_decode.cu's rope_paged_decode_attention_lora
    prologue, reading the extended product's rows, instead of compacting them with lora_expand.cu first
    (bench/ab_switches.py lora_in_attention off): each adapter's HF gate by the floor method, and the same
    scores as the compacting path, one adapter per batch and a batch mixing them with the base model
    (graphed decode)."""
    from bench.ab_switches import ABGpuExecutor, ABGpuOps

    name, model, ex, seqs, oracle = tiny
    assert ABGpuOps.lora_in_attention
    inner = lora_gpu_executor(name, model, executor_class=ABGpuExecutor)
    inner.ops.lora_in_attention = False
    try:
        for slots in [[slot] * len(seqs) for slot in range(len(ADAPTERS))] + [[0, None, 2, 1]]:
            got = engine_logits(ex, seqs, lora_slots=slots, **PATHS["decode"])
            want = engine_logits(inner, seqs, lora_slots=slots, **PATHS["decode"])
            for g, w in zip(got, want):
                assert_same_scores(g, w, 1e-3)
            if len(set(slots)) == 1:
                a = ADAPTERS[slots[0]]
                assert_gate(gate_row(f"{name}/lora-{a}/qkv-in-attention", got, *oracle[a]))
        base_fused = any(key[1] == "rope_paged_decode_attention" for key in inner.ops._decode_kernels)
        assert base_fused == any(key[1] == "rope_paged_decode_attention_lora" for key in ex.ops._decode_kernels)
    finally:
        inner.close()


def test_mixed_batch_equals_each_alone(tiny):
    """Each sequence of a batch mixing every adapter and the base model against the same sequence alone,
    fed in the same pieces (so both take the same product kinds: small steps the extended product, large
    ones lora_shrink + lora_expand, which round the shrink differently: bf16 like HF's bf16 LoRA, or float32)."""
    name, _, ex, seqs, oracle = tiny
    slots, prefill, chunks = [0, 1, 2, None], [None, 3, 7, 16], [1, 1, 5, 9]
    mixed = engine_logits(ex, seqs, lora_slots=slots, prefill=prefill, chunks=chunks)
    for i, (seq, slot) in enumerate(zip(seqs, slots)):
        o32, o16 = oracle[ADAPTERS[slot if slot is not None else 0]]
        floor = float(np.abs(log_softmax(o16[i]) - log_softmax(o32[i])).mean())      # this model's bf16 floor
        alone = engine_logits(ex, [seq], lora_slots=[slot], prefill=prefill[i], chunks=chunks[i])[0]
        assert_same_scores(mixed[i], alone, max(0.02, floor / 2))
        if slot is not None:
            o32, o16 = oracle[ADAPTERS[slot]]
            assert_gate(gate_row(f"{name}/lora-mixed/{ADAPTERS[slot]}", [mixed[i]], [o32[i]], [o16[i]]))


def test_lora_batch1_deterministic(tiny):
    _, _, ex, seqs, _ = tiny
    first = engine_logits(ex, [seqs[0]], lora_slots=[2])[0]
    assert np.array_equal(first, engine_logits(ex, [seqs[0]], lora_slots=[2])[0])


@pytest.mark.parametrize("name", MODELS)
def test_graph_decode_with_adapters_matches_eager(name):
    model = load_model(tiny_model_path(name))
    eager, graphed = lora_gpu_executor(name, model, cuda_graphs=False), lora_gpu_executor(name, model)
    identical = total = 0
    for n in (1, 3, 5, 9):
        prompts = random_sequences(model.config.vocab_size, [3 + 7 * i % 29 for i in range(n)], seed=n)
        slots = [[0, 1, 2, None][i % 4] for i in range(n)]
        g, e = greedy(graphed, prompts, 10, lora_slots=slots), greedy(eager, prompts, 10, lora_slots=slots)
        for p, a, b, slot in zip(prompts, g, e, slots):
            identical += assert_same_or_tie(eager, p, a, b, MIN_TIE_TOL, f"{name} LoRA graph vs eager, batch {n}",
                                            lora_slot=slot)
            total += 1
    print(f"{name}: LoRA graph == eager greedy {identical}/{total} sequences over 10 steps")
    assert sorted(graphed.lora_graphs.graphs) == [1, 4, 8, 16] and not graphed.graphs.graphs
    base = random_sequences(model.config.vocab_size, [9, 4], seed=7)
    assert greedy(graphed, base, 4) and sorted(graphed.graphs.graphs) == [2]      # no adapter: the base graphs
    eager.close()
    graphed.close()


def bf16_round(a: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def rms_normed(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm.cu's rounding: bf16(w · bf16(x · rsqrt(mean(x²) + eps)))."""
    rstd = 1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps)
    return bf16_round(w * bf16_round((x * rstd).astype(np.float32)))


def silu_times(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return bf16_round(bf16_round(g / (1 + np.exp(-g))) * u)


@pytest.fixture(scope="module", params=MODELS)
def kernel_case(request):
    """(executor with the adapters in slots 0..2, NumpyLoRAOps holding the same bf16-rounded adapters)."""
    from engine.executor.cpu_lora_ops import NumpyLoRAOps

    name = request.param
    ex = lora_gpu_executor(name, load_model(tiny_model_path(name)))
    rounded = adapters_of(name, ex)
    for adapter in rounded.values():          # the GPU holds A and the scaled B in bf16
        for w in adapter.sites.values():
            w.a[:] = bf16_round(w.a)
            w.b[:] = bf16_round(w.b)
    ref = NumpyLoRAOps(ex.ops.lora.sites, 3)
    for slot, adapter in enumerate(rounded.values()):
        ref.set_slot(slot, adapter)
    with ex.stream:         # the tests' uploads and reads in order with the executor's kernels
        yield ex, ref
    ex.close()


SITES = ("layers.0.qkv_proj", "layers.0.o_proj", "layers.0.gate_up_proj", "layers.0.down_proj")
KERNEL_ROWS = (1, 7, 9, 33, 200, 500)     # across the tiles and lora_shrink.cu's chunk sizes


def assert_close(got, want, what):
    err = np.abs(got - want) / (1 + np.abs(want))
    assert err.max() < 2e-2, (what, float(err.max()))


@pytest.mark.parametrize("site_name", SITES)
def test_kernels_match_the_numpy_reference(kernel_case, site_name):
    """ops.lora.add at a site of layer 0 for 1 to 500 tokens with a random token -> slot map (a third of the
    rows without an adapter) against NumpyLoRAOps on the same bf16-rounded weights, through each of
    lora_expand.cu's epilogues: into the bf16 output, into a float32 buffer (a split-K partial), SiLU·up
    of the gate_up product; and lora_shrink.cu's RMSNorm prologue for the sites whose input is normed."""
    import cupy

    from engine.executor.gpu_gemm import interleave_gate_up
    from engine.executor.gpu_lora_ops import bf16_bits

    ex, ref = kernel_case
    lora, site = ex.ops.lora, ex.ops.lora.sites[site_name]
    gate_up = site_name.endswith("gate_up_proj")
    interleave = gate_up and ex.ops.shared.gate_up_interleaved
    dev = lambda a: cupy.asarray(bf16_bits(np.ascontiguousarray(a)))
    host = lambda d: d.get().view(__import__("ml_dtypes").bfloat16).astype(np.float32)
    rng = np.random.default_rng(0)
    for rows in KERNEL_ROWS:
        x = bf16_round(rng.standard_normal((rows, site.k)))
        y = bf16_round(rng.standard_normal((rows, site.n)))
        slots = rng.integers(-1, 3, rows).astype(np.int32)
        ref.use(slots)
        want = ref.add(y.copy(), x, site_name)
        y_gpu, want_gpu = (interleave_gate_up(y.T).T, interleave_gate_up(want.T).T) if interleave else (y, want)
        lora.use(slots, rows)
        x_dev, y_dev = dev(x), dev(y_gpu)
        lora.add(y_dev, x_dev, site_name)
        got = host(y_dev)
        assert_close(got, want_gpu, (site_name, rows, "bf16"))
        assert np.array_equal(got[slots < 0], y_gpu[slots < 0])      # rows without an adapter: untouched

        y32 = cupy.asarray(np.ascontiguousarray(y_gpu))
        lora.add(None, x_dev, site_name, into=y32.data.ptr)
        assert_close(y32.get(), want_gpu, (site_name, rows, "float32"))
        assert np.array_equal(y32.get()[slots < 0], y_gpu[slots < 0])

        if site_name.endswith(("qkv_proj", "gate_up_proj")):
            w = bf16_round(rng.uniform(0.5, 1.5, site.k))
            normed_want = ref.add(y.copy(), rms_normed(x, w, 1e-6), site_name)
            normed_want = interleave_gate_up(normed_want.T).T if interleave else normed_want
            y_dev = dev(y_gpu)
            lora.add(y_dev, x_dev, site_name, norm=(dev(w), 1e-6))
            assert_close(host(y_dev), normed_want, (site_name, rows, "norm"))
        if gate_up:
            inter = site.n // 2
            act_want = silu_times(bf16_round(want[:, :inter]), bf16_round(want[:, inter:]))
            act_want[slots < 0] = silu_times(y[slots < 0, :inter], y[slots < 0, inter:])
            act = lora.swiglu(dev(y_gpu), x_dev, site_name)
            assert_close(host(act), act_want, (site_name, rows, "swiglu"))


def test_slot_reloaded_with_another_adapter(tiny):
    """One slot: attn8, then mlp4_rs loaded over it (its attention sites zeroed): mlp4_rs's gate."""
    name, model, _, seqs, oracle = tiny
    ex = lora_gpu_executor(name, model, max_loras=1)
    adapters = adapters_of(name, ex)
    ex.set_lora(0, adapters["mlp4_rs"])
    try:
        engine = engine_logits(ex, seqs, lora_slots=[0] * len(seqs), **PATHS["chunked"])
        assert_gate(gate_row(f"{name}/lora-reloaded/chunked", engine, *oracle["mlp4_rs"]))
    finally:
        ex.close()


def test_engine_serves_more_adapters_than_slots():
    """The engine (graphs, overlap, schedule-ahead) with 2 slots and 3 adapters plus the base model, all
    at once: each request decodes as it does alone, or differs first at a genuine tie."""
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    from engine.request import SamplingParams

    name = "qwen3_tied"
    path = tiny_model_path(name)
    modules = tuple((a, tiny_adapter_path(name, a)) for a in ADAPTERS)
    config = EngineConfig(model=path, device="cuda", num_kv_blocks=256, max_model_len=512, max_num_seqs=16,
                          enable_lora=True, lora_modules=modules, max_loras=2, progress=False)
    prompts = random_sequences(load_model(path).config.vocab_size, [5, 17, 33, 12, 40, 9, 21, 3], seed=3)
    loras = [[*ADAPTERS, None][i % 4] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with EngineHandle(config) as h:
        together = _run(h, prompts, loras, params)
        alone = [_run(h, [p], [lora], params)[0] for p, lora in zip(prompts, loras)]
        assert h.engine.loras.loads > 2
    model = load_model(path)
    ref = lora_gpu_executor(name, model, cuda_graphs=False)
    for p, a, b, lora in zip(prompts, together, alone, loras):
        assert len(a) == 12
        assert_same_or_tie(ref, p, a, b, MIN_TIE_TOL, f"engine LoRA {lora} together vs alone",
                           lora_slot=None if lora is None else ADAPTERS.index(lora))
    ref.close()


def _run(handle, prompts, loras, params) -> list[list[int]]:
    import asyncio

    from engine.events import Token
    from engine.request import GenerateRequest

    async def one(i, p, lora):
        req = GenerateRequest(f"r{i}-{lora}-{len(p)}", list(p), params, lora_name=lora)
        return [e.token_id async for e in handle.submit(req) if isinstance(e, Token)]

    async def main():
        return await asyncio.gather(*(one(i, p, lora) for i, (p, lora) in enumerate(zip(prompts, loras))))
    return list(asyncio.run(main()))


FUSED_ROWS = (1, 4, 9, 33, 64)


@pytest.mark.parametrize("site_name", SITES)
def test_extended_product_matches_shrink_and_expand(kernel_case, site_name):
    """A small step's extended product with the delta in the kernel after it (lora_expand.cu modes 2 and
    3 reading the shrink from the product's output; rms_norm.cu splitk_rms_norm_residual_lora) against the
    same op through lora_shrink + lora_expand (numpy-checked above), a third of the rows without an
    adapter, for each GEMM the rows select (gemv.cu, the CuTe split-K partials or cuBLAS)."""
    import cupy

    from engine.executor.gpu_lora_ops import bf16_bits

    ex, _ = kernel_case
    ops, lora, site = ex.ops, ex.ops.lora, ex.ops.lora.sites[site_name]
    gemm = ops.shared.gemm
    if site_name not in lora.full:
        pytest.skip("this executor's sites do not take the extended product")
    weight = ex.weights[site_name]
    dev = lambda a: cupy.asarray(bf16_bits(np.ascontiguousarray(a)))
    host = lambda d: d.get().view(__import__("ml_dtypes").bfloat16).astype(np.float32)
    rng = np.random.default_rng(1)
    norm_w = dev(bf16_round(rng.uniform(0.5, 1.5, site.k)))
    for rows in FUSED_ROWS:
        x = dev(bf16_round(rng.standard_normal((rows, site.k))))
        slots = rng.integers(-1, 3, rows).astype(np.int32)
        lora.use(slots, rows)
        what = (site_name, rows)
        if site_name.endswith("qkv_proj"):
            got = host(lora.norm_linear(x, norm_w, 1e-6, site_name))
            normed, _ = ops.rms_norm(x, norm_w, 1e-6)
            want = ops.activation(rows, site.n)
            gemm(normed, weight, want)
            lora.add(want, normed, site_name)
            assert_close(got, host(want), what)
        elif site_name.endswith("gate_up_proj"):
            got = host(lora.norm_swiglu(x, norm_w, 1e-6, site_name))
            normed, _ = ops.rms_norm(x, norm_w, 1e-6)
            gate_up = ops.activation(rows, site.n)
            gemm(normed, weight, gate_up)
            assert_close(got, host(lora.swiglu(gate_up, normed, site_name)), what)
        else:
            residual = dev(bf16_round(rng.standard_normal((rows, site.n))))
            kept = residual.copy()
            out, normed = lora.add_linear_norm(x, site_name, residual, norm_w, 1e-6)
            got, got_normed = host(out).copy(), host(normed).copy()
            y = cupy.zeros((rows, site.n), np.float32)
            gemm(x, weight, y)                          # float32 product (cuBLAS), then the delta into it
            lora.add(None, x, site_name, into=y.data.ptr)
            want = bf16_round(y.get() + host(kept))
            assert_close(got, want, what)
            want_normed = host(ops.rms_norm(dev(want), norm_w, 1e-6)[0])
            assert_close(got_normed, want_normed, what + ("norm",))
        lora.use(None, rows)
