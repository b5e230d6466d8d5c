"""The decode kernels (paged_decode.cu, gemv.cu) against numpy references: fresh random inputs,
poisoned outputs and partials, odd shapes, split counts 1..64 (in-kernel merge, its tickets reset),
the Qwen3-4B/8B projection shapes, the executor's Gemm routing (small M to gemv.cu, larger M to
cuBLAS), and greedy decode through the executor with the new kernels == the default kernels."""
from __future__ import annotations

import numpy as np
import pytest

from test_raw_cuda_kernels import attention_case, attention_ref, bits, dev, f32, poison

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.mark.parametrize("D,Hq,Hkv,splits", [(128, 32, 8, 1), (128, 32, 8, 33), (128, 32, 8, 7), (16, 8, 2, 3),
                                             (64, 4, 4, 16), (32, 4, 2, 64), (96, 8, 8, 5), (256, 8, 2, 4),
                                             (128, 64, 8, 2)])
def test_paged_decode_attention(cp, D, Hq, Hkv, splits):
    from engine.executor.attention_grid import decode_attention_fits
    from openinfer_kernels.raw_cuda import kernel

    G = Hq // Hkv
    assert decode_attention_fits(G, D)
    rng = np.random.default_rng(D + Hq + splits)
    kc, vc, tables, token_seq, positions = attention_case(rng, D, Hkv)
    T, S = len(positions), splits
    q = bits(rng.standard_normal((T, Hq, D)))
    part_out = cp.full((T * Hq * S * D,), np.nan, np.float32)
    part_max, part_sum = cp.full((T * Hq * S,), np.nan, np.float32), cp.full((T * Hq * S,), np.nan, np.float32)
    counters = cp.zeros(T * Hkv, np.int32)
    scale = D ** -0.5
    ref = attention_ref(f32(q), f32(kc), f32(vc), tables, token_seq, positions, scale, G)
    args = (dev(cp, q), dev(cp, kc), dev(cp, vc), dev(cp, tables), np.int32(48), dev(cp, token_seq),
            dev(cp, positions), part_out, part_max, part_sum)
    for launch in range(2):                   # the split tickets are back at zero for the next launch
        out = poison(cp, (T, Hq * D))
        kernel("paged_decode", "paged_decode_attention", GQA=G, HEAD_DIM=D)(
            (T, S, Hkv), (128,), args + (out, counters, np.int32(Hkv), np.float32(scale)))
        got = f32(out.get())
        assert np.all(np.isfinite(got)), launch
        np.testing.assert_allclose(got, ref, atol=1.5e-2, rtol=1e-2)
        assert not counters.get().any()


def gemv_ref(x, w):
    return f32(x).astype(np.float64) @ f32(w).astype(np.float64).T


SHAPES = [(1, 40, 264), (3, 17, 8), (8, 100, 2568), (9, 16, 32), (16, 2560, 4096), (17, 33, 72), (32, 65, 520),
          (1, 6144, 2560), (4, 2560, 9728), (16, 4096, 4096), (2, 1024, 12288)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("fp32_out", [False, True])
@pytest.mark.parametrize("unroll", [2, 4, 8])          # GEMV_U: k steps per weight batch
@pytest.mark.parametrize("pad", [0, 40])               # columns after each weight row (a view of wider rows)
def test_gemv(cp, M, N, K, fp32_out, unroll, pad):
    from openinfer_kernels.raw_cuda import kernel

    rng = np.random.default_rng(M * 7 + N + K)
    x, w = bits(rng.standard_normal((M, K))), bits(rng.standard_normal((N, K)) * K ** -0.5)
    wide = np.full((N, K + pad), 0x7FC1, np.uint16)    # the columns past K are NaN: never read
    wide[:, :K] = w
    dtype = np.float32 if fp32_out else np.uint16
    y = poison(cp, (M + 1, N), dtype)                  # row M must stay poisoned
    nt = -(-M // 8)
    null = np.uint64(0)
    kernel("gemv", f"gemv_{'f32' if fp32_out else 'bf16'}_n{nt}", GEMV_U=unroll)(
        (-(-N // 16),), (256,), (dev(cp, x), dev(cp, wide), y, np.int32(M), np.int32(N), np.int32(K), null, null,
                                 np.float32(0), np.int32(K + pad)))
    got = y.get()
    tail = got[M]
    assert np.all(np.isnan(tail)) if fp32_out else np.all(tail == 0x7FC1)
    got = got[:M] if fp32_out else f32(got[:M])
    ref = gemv_ref(x, w)
    tol = 1e-4 if fp32_out else 8e-3                   # fp32 summation order / one bf16 rounding
    np.testing.assert_allclose(got, ref, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
def test_gemm_routes_small_m_to_gemv(cp, M):
    """Gemm(gemv_max_m=16) matches cuBLAS (Gemm()) on both sides of the threshold, bf16 and fp32 out
    (fp32 out, the logits, runs on cuBLAS unless the caller asks gemv_f32)."""
    from engine.executor.gpu_gemm import Gemm

    rng = np.random.default_rng(M)
    N, K = 336, 2560
    x, w = dev(cp, bits(rng.standard_normal((M, K)))), dev(cp, bits(rng.standard_normal((N, K)) * K ** -0.5))
    stream = cp.cuda.Stream()                 # blocking: ordered after the inputs' uploads and fills
    small, blas = Gemm(stream, gemv_max_m=16), Gemm(stream)
    for dtype in (np.uint16, np.float32):
        a, b = poison(cp, (M, N), dtype), poison(cp, (M, N), dtype)
        small(x, w, a)
        blas(x, w, b)
        stream.synchronize()
        fa, fb = (a.get(), b.get()) if dtype == np.float32 else (f32(a.get()), f32(b.get()))
        np.testing.assert_allclose(fa, fb, atol=1e-2 if dtype == np.uint16 else 1e-4, rtol=1e-2)
        np.testing.assert_allclose(fa, gemv_ref(x.get(), w.get()), atol=2e-2, rtol=1e-2)
    assert small._gemv if M <= 16 else not small._gemv      # the kernels it compiled say which path ran
    assert all(variant == "bf16" for _, variant, _ in small._gemv)
    a = poison(cp, (M, N), np.float32)                      # gemv_f32 (DeepSeek-V4's projections): gemv.cu's f32
    small(x, w, a, gemv_f32=True)
    stream.synchronize()
    np.testing.assert_allclose(a.get(), gemv_ref(x.get(), w.get()), atol=1e-3, rtol=1e-3)
    assert any(variant == "f32" for _, variant, _ in small._gemv) == (M <= 16)
    small.close()
    blas.close()


def test_executor_decode_kernels_match_default():
    """Greedy decode with the new decode kernels (eager and graphs) equals the default kernels', or
    differs only at a tie of the default executor's own logprobs. Every executor here keeps cuBLAS
    for what the GEMV does not take, so that only the decode kernels differ (the GEMM libraries
    have gates of their own: test_gpu_executor.test_tiny_gate_gemm_library)."""
    from engine.loader import load_model
    from harness.models import tiny_model_path
    from harness.executors import new_gpu_executor
    from harness.models import random_sequences
    from bench.ab_switches import ABGpuExecutor
    from test_gpu_executor import MIN_TIE_TOL, assert_same_or_tie, greedy

    model = load_model(tiny_model_path("qwen3_gqa4"))
    old = new_gpu_executor(model, cuda_graphs=False, decode_kernels="", gemm="cublas")
    new = new_gpu_executor(model, decode_kernels="attention,gemv", gemm="cublas")
    new_eager = new_gpu_executor(model, cuda_graphs=False, decode_kernels="all", gemm="cublas")
    assert new.ops.fast_attention and new.gemm.gemv_max_m == new.default_gemv_rows() and not old.ops.fast_attention
    prompts = random_sequences(model.config.vocab_size, [5, 30, 17, 64, 1], seed=9)
    ref = greedy(old, prompts, 16)
    switched = new_gpu_executor(model, ABGpuExecutor, decode_kernels="", gemm="cublas")
    greedy(switched, prompts, 4)                      # graphs captured with the default kernels ...
    switched.set_decode_kernels("attention,gemv:32")  # ... dropped: recaptured with the new ones
    assert switched.ops.fast_attention and switched.gemm.gemv_max_m == 32
    for ex, what in ((new, "graphs"), (new_eager, "eager"), (switched, "switched")):
        got = greedy(ex, prompts, 16)
        for p, a, b in zip(prompts, got, ref):
            assert_same_or_tie(old, p, a, b, MIN_TIE_TOL, f"decode kernels ({what}) vs default")
    assert switched.gemm._gemv and switched.ops._decode_kernels
    for ex in (old, new, new_eager, switched):
        ex.close()
