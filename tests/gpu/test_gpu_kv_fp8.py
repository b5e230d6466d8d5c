"""--kv-cache-dtype fp8 on the GPU executor, by the floor method (DESIGN.md), and its kernels against numpy.

Oracle: transformers float32 with its cached K and V rounded through e4m3 (harness/fp8_kv.py); floor: the same
model in bf16 (K and V rounded the same way) against it. The floor is wider than the bf16 one, since a bf16
rounding of K moves some values across an e4m3 boundary: measured on CPU (transformers 5.25, 2026-12-06), mean
|Δlogprob| 0.194 / 0.066 / 0.040 (qwen3_tied / llama / qwen3_gqa4) against the bf16 floor's 0.090 / 0.021 / 0.015.
The gate is test_gpu_executor's (argmax by regret within the floor's p99, mean <= max(0.02, 2 x the floor's mean))
over prefill (CuTe through kv_gather_fp8's staging, and paged_decode_attention_fp8), decode and chunked prefill,
and the MLA lines (deepseek_v3, deepseek_v2_lite) through the latent cache's FP8 kernels; then CUDA graphs against
eager, a prefix hit and a host-tier restore against the cold run, the pool's blocks, and
each FP8 kernel entry against numpy (tests/kernels/test_kv_fp8_kernels_emulated.py runs the same on the host).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.loader import load_model
from harness.executors import new_gpu_executor
from harness.fp8_kv import fp8_case, hf_fp8_kv_logits
from harness.models import engine_logits, random_sequences, tiny_model_path
from memory.kv_format import E4M3, dequantize_e4m3, quantize_e4m3
from test_decode_kernels_emulated import paged_attention_reference
from test_gpu_executor import MIN_TIE_TOL, assert_gate, assert_same_or_tie, gate_row, greedy

pytestmark = pytest.mark.gpu
PATHS = {"prefill": dict(), "decode": dict(prefill=[20, 7, 33, 1], chunks=1), "chunked": dict(chunks=[7, 16, 5, 9],
                                                                                                  seed=3)}


def fp8_executor(model, **settings):
    return new_gpu_executor(model, kv_cache_dtype="fp8", **settings)


# the MLA lines keep their latent rows as e4m3 (gpu_mla_ops.py's FP8 kernel forms): deepseek_v3 with the q LoRA,
# deepseek_v2_lite without it (mla_absorb_q_cache_fp8 at decode)
@pytest.fixture(scope="module", params=["qwen3_tied", "llama", "qwen3_gqa4", "deepseek_v3", "deepseek_v2_lite"])
def tiny(request):
    path, model, seqs, ones = fp8_case(request.param)
    mla = ones.shape[1] == 1
    o32, o16 = (hf_fp8_kv_logits(path, seqs, ones, mla=mla, dtype=d) for d in ("float32", "bfloat16"))
    ex = fp8_executor(model)
    yield request.param, model, ex, seqs, o32, o16
    ex.close()


@pytest.mark.parametrize("path_name", sorted(PATHS))
def test_fp8_kv_gate(tiny, path_name):
    name, _, ex, seqs, o32, o16 = tiny
    assert ex.kv_cache.dtype == np.uint8
    before = ex.prefill.launches if ex.prefill is not None else 0
    assert_gate(gate_row(f"fp8-kv/{name}/{path_name}", engine_logits(ex, seqs, **PATHS[path_name]), o32, o16))
    if path_name == "prefill" and ex.prefill is not None and "mla" not in ex.plan.families:
        assert ex.prefill.launches > before             # the CuTe path ran over the staged (widened) KV


@pytest.mark.parametrize("name", ["qwen3_gqa4", "deepseek_v3"])
def test_fp8_graphs_decode_as_eager(name):
    model = load_model(tiny_model_path(name))
    eager, graphed = fp8_executor(model, cuda_graphs=False), fp8_executor(model)
    for n in (1, 3, 9):
        prompts = random_sequences(model.config.vocab_size, [3 + 7 * i % 29 for i in range(n)], seed=n)
        for p, a, b in zip(prompts, greedy(graphed, prompts, 12), greedy(eager, prompts, 12)):
            assert_same_or_tie(eager, p, a, b, MIN_TIE_TOL, f"fp8 graph vs eager, batch {n}")
    eager.close()
    graphed.close()


def test_fp8_prefix_hit_and_host_tier_restore_generate_the_cold_run():
    """A prefix restored from the host tier (e4m3 bytes, 1 per value), a device prefix hit and a recomputed
    prefix all generate what the cold run generated."""
    from test_host_tier import cached, tokens
    from test_kv_fp8 import host_tier_runs

    runs = host_tier_runs(fp8_executor, max_num_seqs=16, max_num_batched_tokens=512)
    (a0, b0), (a1, b1), (a2, b2) = runs.values()
    assert tokens(a0) == tokens(b0) == tokens(a1) == tokens(b1) == tokens(a2) == tokens(b2)
    assert cached(b1) == cached(b2) == 64 and cached(b0) == 0     # restored, hit; evicted: recomputed


def test_fp8_pool_holds_twice_the_blocks():
    model = load_model(tiny_model_path("qwen3_gqa4"))
    counts = {}
    for dtype in ("auto", "fp8"):
        ex = new_gpu_executor(model, num_kv_blocks=None, gpu_memory_utilization=0.3, kv_cache_dtype=dtype)
        assert ex.kv_cache.nbytes == ex.num_kv_blocks * ex.kv_block_bytes
        counts[dtype] = ex.num_kv_blocks / ex.kv_cache.nbytes
        ex.close()
    # blocks per pool byte: the two pools' bytes differ with what else holds device memory when each starts
    # (the budget is utilization x total - memory in use, and other processes share the GPU)
    assert counts["fp8"] >= 1.99 * counts["auto"], counts


# ---- the kernels on the device against numpy -------------------------------------------------------------
def device(a):
    import cupy
    return cupy.asarray(a)


def bf16_bits(x):
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_values(bits):
    import ml_dtypes
    return np.asarray(bits).view(ml_dtypes.bfloat16).astype(np.float32)


def test_fp8_rope_cache_and_gather_kernels():
    """qk_norm_rope_cache_fp8 stores exactly the e4m3 of the bf16 entry's k / k_scale, v / v_scale (saturated);
    kv_gather_fp8 stages exactly bf16(e4m3 · scale)."""
    import cupy

    from openinfer_kernels.raw_cuda import kernel
    rng = np.random.default_rng(0)
    T, Hq, Hkv, D, k_scale, v_scale = 4, 8, 2, 128, 0.004, 0.3
    qkv = device(bf16_bits(2 * rng.standard_normal((T, (Hq + 2 * Hkv) * D))))
    inv_freq = device((1.0 / (1e6 ** (np.arange(0, D, 2) / D))).astype(np.float32))
    positions, slots = device(np.array([3, 17, 40, 2], np.int32)), device(np.array([5, 33, -1, 60], np.int32))
    caches = {}
    for fp8 in (False, True):
        q = cupy.zeros((T, Hq, D), cupy.uint16)
        kc, vc = (cupy.zeros((64, Hkv, D), cupy.uint8 if fp8 else cupy.uint16) for _ in range(2))
        extra = (np.float32(k_scale), np.float32(v_scale)) if fp8 else ()
        kernel("qk_norm_rope_cache", "qk_norm_rope_cache_fp8" if fp8 else "qk_norm_rope_cache")(
            (T, 1), (256,), (qkv, np.uint64(0), np.uint64(0), np.float32(1e-6), inv_freq, np.float32(1.0), positions,
                             slots, q, kc, vc, np.int32(Hq), np.int32(Hkv), np.int32(D)) + extra)
        caches[fp8] = (q.get(), kc.get(), vc.get())
    np.testing.assert_array_equal(caches[True][0], caches[False][0])
    for plane, scale in ((1, k_scale), (2, v_scale)):
        want = quantize_e4m3(bf16_values(caches[False][plane]), scale).view(np.uint8)
        np.testing.assert_array_equal(caches[True][plane], want)
    kc8, vc8 = caches[True][1], caches[True][2]
    tables, cu_k = np.array([[2, 0], [3, 1]], np.int32), np.array([0, 21, 50], np.int32)
    k_out, v_out = (cupy.zeros((50, Hkv, D), cupy.uint16) for _ in range(2))
    kernel("kv_gather", "kv_gather_fp8")((2, 2), (256,), (device(kc8), device(vc8), device(tables), np.int32(2),
                                                          device(cu_k), k_out, v_out, np.int32(Hkv * D // 8),
                                                          np.float32(k_scale), np.float32(v_scale)))
    for cache, got, scale in ((kc8, k_out, k_scale), (vc8, v_out, v_scale)):
        rows = np.concatenate([cache.reshape(-1, 16, Hkv, D)[tables[b]].reshape(-1, Hkv, D)[:n]
                               for b, n in enumerate((21, 29))])
        np.testing.assert_array_equal(got.get(), bf16_bits(dequantize_e4m3(rows.view(E4M3), scale)))


@pytest.mark.parametrize("group,splits", [(4, 1), (4, 3), (8, 2)])
def test_fp8_decode_attention_kernel(group, splits):
    """paged_decode_attention_fp8 against float32 attention over the dequantized cache."""
    import cupy

    from openinfer_kernels.raw_cuda import kernel
    rng = np.random.default_rng(group + splits)
    T, Hkv, D, k_scale, v_scale = 5, 2, 128, 0.02, 0.3
    Hq = group * Hkv
    contexts = [5 + 37 * t for t in range(T)]
    blocks = [-(-c // 16) for c in contexts]
    perm = rng.permutation(sum(blocks) + 2).astype(np.int32)
    tables = np.zeros((T, max(blocks)), np.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n], at = perm[at:at + n], at + n
    positions = np.array([c - 1 for c in contexts], np.int32)
    k8, v8 = (quantize_e4m3(rng.standard_normal((len(perm) * 16, Hkv, D)) * s * 40, s) for s in (k_scale, v_scale))
    q = bf16_bits(2 * rng.standard_normal((T, Hq, D)))
    out = cupy.zeros((T, Hq * D), cupy.uint16)
    kernel("paged_decode", "paged_decode_attention_fp8", GQA=group, HEAD_DIM=D)(
        (T, splits, Hkv), (128,),
        (device(q), device(k8.view(np.uint8)), device(v8.view(np.uint8)), device(tables), np.int32(tables.shape[1]),
         device(np.arange(T, dtype=np.int32)), device(positions), cupy.zeros(T * Hq * splits * D, cupy.float32),
         cupy.zeros(T * Hq * splits, cupy.float32), cupy.zeros(T * Hq * splits, cupy.float32), out,
         cupy.zeros(T * Hq, cupy.int32), np.int32(Hkv), np.float32(D ** -0.5), np.float32(k_scale),
         np.float32(v_scale)))
    want = paged_attention_reference(bf16_values(q), dequantize_e4m3(k8, k_scale), dequantize_e4m3(v8, v_scale),
                                     tables, positions)
    np.testing.assert_allclose(bf16_values(out.get()).reshape(T, Hq, D), want, rtol=1.6e-2, atol=1e-3)
