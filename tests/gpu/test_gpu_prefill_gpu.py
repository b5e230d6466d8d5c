"""The CuTe prefill attention path on the GPU: kv_gather.cu against numpy; GpuOps.attention through
gpu_prefill (gather + CuTe varlen attention, the paged kernel for the rest) against the paged kernel
alone and a float reference on one mixed step; and the executor gate against HF with the path on, on
tiny Qwen3 models whose head_dim (128, 64) the CuTe kernel takes (the TINY_MODELS use 16 / 32)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from engine.executor.gpu_inputs import GpuStepContext
from engine.executor.gpu_plan import DeviceInfo
from engine.loader import load_model
from engine.models.ops import AttentionSpec
from harness.executors import new_gpu_executor
from harness.models import build_tiny_model, engine_logits, random_sequences
from test_gpu_executor import PATHS, assert_gate, gate_row, hf_gpu_models, hf_run
from test_gpu_chunk import SHORT_RUNS
from test_gpu_prefill import MIXED, mixed_batch
from test_raw_cuda_kernels import attention_ref, bits, f32

pytestmark = pytest.mark.gpu
POISON = 0x7FC1


def cute_or_skip():
    import openinfer_kernels.cute as cute

    ok = cute.available()
    if not ok:
        pytest.skip(f"CuTe library unavailable: {ok.reason}")


@pytest.mark.parametrize("D,Hkv", [(128, 8), (64, 2), (128, 1)])
def test_kv_gather_matches_numpy(D, Hkv):
    import cupy as cp

    from openinfer_kernels.raw_cuda import kernel

    rng = np.random.default_rng(D + Hkv)
    lens = [1, 17, 300, 33, 16]
    blocks = [-(-n // 16) for n in lens]
    nblocks = sum(blocks) + 7
    perm = rng.permutation(nblocks).astype(np.int32)
    width = max(blocks) + 3
    tables = rng.integers(0, nblocks, (len(lens), width)).astype(np.int32)     # garbage past each table
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n], at = perm[at:at + n], at + n
    kc = rng.integers(0, 1 << 16, (nblocks * 16, Hkv, D), dtype=np.uint16)
    vc = rng.integers(0, 1 << 16, (nblocks * 16, Hkv, D), dtype=np.uint16)
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows = int(cu_k[-1]) + 5                                                   # 5 rows past the end stay poisoned
    k_out, v_out = cp.full((rows, Hkv, D), POISON, np.uint16), cp.full((rows, Hkv, D), POISON, np.uint16)
    kernel("kv_gather", "kv_gather")((max(blocks), len(lens)), (256,),
                                     (cp.asarray(kc), cp.asarray(vc), cp.asarray(tables), np.int32(width),
                                      cp.asarray(cu_k), k_out, v_out, np.int32(Hkv * D // 8)))
    want_k = np.full((rows, Hkv, D), POISON, np.uint16)
    want_v = want_k.copy()
    for b, n in enumerate(lens):
        p = np.arange(n)
        slots = tables[b, p // 16] * 16 + p % 16
        want_k[cu_k[b]:cu_k[b + 1]], want_v[cu_k[b]:cu_k[b + 1]] = kc[slots], vc[slots]
    np.testing.assert_array_equal(k_out.get(), want_k)
    np.testing.assert_array_equal(v_out.get(), want_v)


def run_attention(cp, D: int, Hq: int, Hkv: int, settings: list[tuple[int | None, int]], seed: int,
                  steps=MIXED, chunk: bool = False):
    """One mixed step (MIXED: a decode, a long prompt, a short chunk, a chunk after a cached prefix) through
    GpuOps.attention, once per (min_query or None for the paged kernel alone, scratch rows) setting, with
    paged_chunk.cu serving the short runs if `chunk`: (float outputs, float reference, launches per
    setting: CuTe launches, and chunk-kernel launches if `chunk`)."""
    from engine.executor.gpu_ops import GpuOps
    from engine.executor.gpu_prefill import PrefillAttention
    from engine.executor.gpu_shared import GpuShared
    from engine.executor.options import GpuTuning
    from memory.device_arena import DeviceArena

    rng = np.random.default_rng(seed)
    b = mixed_batch(rng, steps)
    T, B = b.num_tokens, len(b.seqs)
    slots = (int(b.block_tables.max()) + 1) * 16
    kv_host = bits(rng.standard_normal((1, 2, slots, Hkv, D)))
    q_host = bits(rng.standard_normal((T, Hq, D)))
    stream = cp.cuda.Stream(non_blocking=True)
    arena = DeviceArena(256 << 20)
    kv = arena.take("kv", kv_host.shape, np.uint16)
    kv.set(kv_host)
    plan = SimpleNamespace(max_tokens=T, width=Hq * D, hidden=Hq * D, vocab=8, logit_rows=1, num_heads=Hq,
                           head_dim=D, device=DeviceInfo.query(), families=frozenset(),
                           options=SimpleNamespace(gpu=GpuTuning(decode_kernels="attention")))
    shared = GpuShared.take(arena, plan, stream=stream, gemm=None, kv_cache=kv, inv_freq=cp.zeros(D // 2, np.float32),
                            attention_factor=1.0)
    ops = GpuOps(plan, shared, arena, 0)
    seq = np.repeat(np.arange(B, dtype=np.int32), np.diff(b.cu_seqlens))
    ctx = GpuStepContext(num_tokens=T, input_ids=cp.zeros(T, np.int32), positions=cp.asarray(b.positions),
                         slot_mapping=cp.asarray(b.slot_mapping), token_seq=cp.asarray(seq),
                         block_tables=cp.asarray(b.block_tables), sample_rows=cp.zeros(1, np.int32),
                         num_splits=ops.splits(T, Hkv, int(b.context_lens.max())))
    q = cp.asarray(q_host)
    spec = AttentionSpec(layer=0, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, rms_eps=1e-6, scale=D ** -0.5)
    cp.cuda.Device().synchronize()
    outs, launches = [], []
    for min_query, key_rows in settings:
        for r in ops.shared.ring:
            r.fill(POISON)
        cp.cuda.Device().synchronize()
        prefill = None
        if min_query is not None:
            pa = PrefillAttention(arena, stream, T, B, key_rows, Hkv, D, min_query, group=Hq // Hkv if chunk else 0)
            prefill = pa.step(b)
        out = ops.attention(q, spec, dataclasses.replace(ctx, prefill=prefill))
        host = out.get(stream=stream)
        stream.synchronize()
        assert (host != POISON).all(), (min_query, key_rows)
        outs.append(f32(host))
        if prefill is None:
            launches.append((0, 0) if chunk else 0)
        else:
            launches.append((pa.launches, pa.chunk.launches) if chunk else pa.launches)
    arena.close()
    ref = attention_ref(f32(q_host), f32(kv_host[0, 0]), f32(kv_host[0, 1]), b.block_tables, seq, b.positions,
                        D ** -0.5, Hq // Hkv)
    return outs, ref, launches


@pytest.mark.parametrize("D,Hq,Hkv", [(128, 8, 2), (64, 8, 8), (128, 16, 2)])
def test_prefill_attention_matches_paged_kernel(D, Hq, Hkv):
    import cupy as cp

    cute_or_skip()
    # paged alone; CuTe for seqs 1-3 in one launch; for seqs 1 and 3 in two (the 20-token chunk between
    # them paged); every sequence (the decode too) with a 400-row scratch (launches split, the 500-key
    # decode paged); every sequence in one launch
    settings = [(None, 0), (16, 4096), (32, 4096), (1, 400), (1, 4096)]
    outs, ref, launches = run_attention(cp, D, Hq, Hkv, settings, seed=D + Hq)
    assert launches == [0, 1, 2, 2, 1]
    for (min_query, key_rows), got in zip(settings, outs):
        what = f"min_query {min_query}, scratch {key_rows}"
        np.testing.assert_allclose(got, ref, atol=1.5e-2, rtol=1e-2, err_msg=what)
        np.testing.assert_allclose(got, outs[0], atol=2e-2, rtol=2e-2, err_msg=what + " vs the paged kernel")


@pytest.mark.parametrize("D,Hq,Hkv", [(128, 32, 8), (128, 8, 2), (64, 8, 8), (128, 16, 1)])
def test_chunk_kernel_matches_reference(D, Hq, Hkv):
    """paged_chunk.cu (tensor cores, split over the keys, P in bf16) against the float reference and the
    paged kernel, with CuTe serving the long prompt or nothing."""
    import cupy as cp

    cute_or_skip()
    settings = [(None, 0), (64, 8192), (1000, 8192)]
    outs, ref, launches = run_attention(cp, D, Hq, Hkv, settings, seed=D + Hq + Hkv, steps=SHORT_RUNS, chunk=True)
    assert launches == [(0, 0), (1, 1), (0, 1)]
    for (min_query, key_rows), got in zip(settings, outs):
        what = f"min_query {min_query}"
        np.testing.assert_allclose(got, ref, atol=1.5e-2, rtol=1e-2, err_msg=what)
        np.testing.assert_allclose(got, outs[0], atol=2e-2, rtol=2e-2, err_msg=what + " vs the paged kernel")


# ---- executor gate vs HF with the CuTe path on ---------------------------------------------------
CUTE_MODELS = {"qwen3_tied": dict(head_dim=128), "qwen3_gqa4": dict(head_dim=64)}


@pytest.fixture(scope="module", params=sorted(CUTE_MODELS))
def cute_model(request, tmp_path_factory):
    cute_or_skip()
    path = build_tiny_model(request.param, str(tmp_path_factory.mktemp(request.param)), **CUTE_MODELS[request.param])
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=5)
    m32, m16 = hf_gpu_models(path)
    o32, o16 = [hf_run(m32, s) for s in seqs], [hf_run(m16, s) for s in seqs]
    del m32, m16
    yield f"{request.param}_d{model.config.head_dim}", model, seqs, o32, o16


# (path, switch): whole prompts served from 16 tokens; every non-decode step served, chunks on a cached
# prefix and single-token rows included
CUTE_PATHS = [("prefill", "cute:16"), ("chunked", "cute:1"), ("decode", "cute:1")]


@pytest.mark.parametrize("path_name,switch", CUTE_PATHS)
def test_gate_with_cute_prefill(cute_model, path_name, switch):
    name, model, seqs, o32, o16 = cute_model
    ex = new_gpu_executor(model, prefill_attention=switch)
    assert ex.prefill is not None and ex.prefill.min_query == int(switch.split(":")[1])
    engine = engine_logits(ex, seqs, **PATHS[path_name])
    assert ex.prefill.launches > 0
    assert_gate(gate_row(f"{name}/{path_name}/{switch}", engine, o32, o16))
    ex.close()


def test_paged_switch_keeps_the_old_path(cute_model, monkeypatch):
    monkeypatch.setenv("OPENINFER_PREFILL_ATTENTION", "paged")
    ex = new_gpu_executor(cute_model[1])
    assert ex.prefill is None
    ex.close()
