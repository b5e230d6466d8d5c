"""gemv.cu's fused variants (RMSNorm prologue, residual-add and SiLU·up epilogues) against the
composition of the separate ops in numpy with the same bf16 roundings, and programmatic dependent
launches in a captured CUDA graph against the same chain launched plainly (bit-identical)."""
from __future__ import annotations

import numpy as np
import pytest

from openinfer_kernels.raw_cuda import kernel
from openinfer_kernels.raw_cuda.launch import launch
from test_raw_cuda_kernels import bits, dev, f32, poison, rb

pytestmark = pytest.mark.gpu
SHAPES = [(1, 2560, 2560), (3, 40, 264), (9, 6144, 2560), (16, 100, 2568), (17, 33, 72), (32, 2560, 512),
          (1, 2560, 9728), (5, 1000, 4104)]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def gemm(cp):
    from engine.executor.gpu_gemm import Gemm
    g = Gemm(cp.cuda.Stream(), gemv_max_m=32)
    yield g
    g.close()


def rms_ref(x, w, eps):
    x = f32(x)
    return rb(f32(w) * rb(x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)))


def matmul(a, w):
    return a.astype(np.float64) @ f32(w).astype(np.float64).T


def close(got, ref):
    np.testing.assert_allclose(f32(got), ref, atol=3.2e-2, rtol=8e-3)   # one bf16 rounding, summation order


def case(rng, M, N, K, in_cols=None):
    x = bits(rng.standard_normal((M, in_cols or K)) * 2)
    w = bits(rng.standard_normal((N, K)) * K ** -0.5)
    return x, w


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_gemv_rmsnorm_prologue(cp, gemm, M, N, K):
    rng = np.random.default_rng(M + N + K)
    x, w = case(rng, M, N, K)
    nw, eps = bits(1 + 0.1 * rng.standard_normal(K)), 1e-6
    y = poison(cp, (M + 1, N))
    gemm.gemv(dev(cp, x), dev(cp, w), y[:M], "norm", norm_w=dev(cp, nw), eps=eps)
    gemm.stream.synchronize()
    got = y.get()
    assert np.all(got[M] == 0x7FC1)
    close(got[:M], rb(matmul(rms_ref(x, nw, eps), w)))


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_gemv_residual_epilogue(cp, gemm, M, N, K, in_place):
    rng = np.random.default_rng(2 * M + N + K)
    x, w = case(rng, M, N, K)
    res = bits(rng.standard_normal((M, N)))
    r = dev(cp, res)
    y = r if in_place else poison(cp, (M, N))
    gemm.gemv(dev(cp, x), dev(cp, w), y, "res", res_in=r)
    gemm.stream.synchronize()
    close(y.get(), rb(rb(matmul(f32(x), w)) + f32(res)))
    if not in_place:
        np.testing.assert_array_equal(r.get(), res)


def silu_ref(gate, up):
    return rb(rb(gate / (1 + np.exp(-gate))) * up)


@pytest.mark.parametrize("M,I,K", [(1, 2560, 2560), (3, 16, 72), (9, 80, 264), (16, 512, 2568), (17, 24, 520),
                                   (32, 2048, 512)])
def test_gemv_silu_epilogue(cp, gemm, M, I, K):
    """norm_silu on the interleaved gate_up weight == its parts: the "norm" GEMV, then silu_mul.cu in
    interleaved mode (bit for bit), and the numpy composition on the un-interleaved weight; silu_mul.cu's
    interleaved mode == its [gate | up] mode on the same values; "silu" (no norm) == the "bf16" GEMV, then
    silu_mul.cu."""
    from engine.executor.gpu_gemm import interleave_gate_up

    rng = np.random.default_rng(3 * M + I + K)
    x, w = case(rng, M, 2 * I, K)
    nw, eps = bits(1 + 0.1 * rng.standard_normal(K)), 1e-6
    wi = interleave_gate_up(w)
    assert np.array_equal(wi[8:16], w[I:I + 8]) and np.array_equal(wi[16:24], w[8:16])
    xd, nwd, wid = dev(cp, x), dev(cp, nw), dev(cp, wi)
    fused = poison(cp, (M + 1, I))
    gemm.gemv(xd, wid, fused[:M], "norm_silu", norm_w=nwd, eps=eps)
    gate_up = poison(cp, (M, 2 * I))
    gemm.gemv(xd, wid, gate_up, "norm", norm_w=nwd, eps=eps)
    silu = kernel("silu_mul", "silu_mul")
    parts, plain = poison(cp, (M, I)), poison(cp, (M, I))
    total = np.int64(M * I // 8)
    silu((64,), (256,), (gate_up, parts, np.int32(I), total, np.int32(1)), stream=gemm.stream)
    gu = gate_up.get().reshape(M, I // 8, 2, 8)
    un = dev(cp, np.concatenate([gu[:, :, 0].reshape(M, I), gu[:, :, 1].reshape(M, I)], 1))
    silu((64,), (256,), (un, plain, np.int32(I), total, np.int32(0)), stream=gemm.stream)
    gemm.stream.synchronize()
    got = fused.get()
    assert np.all(got[M] == 0x7FC1)
    np.testing.assert_array_equal(got[:M], parts.get())
    np.testing.assert_array_equal(plain.get(), parts.get())
    h = rb(matmul(rms_ref(x, nw, eps), w))
    ref = silu_ref(h[:, :I], h[:, I:])
    np.testing.assert_allclose(f32(got[:M]), ref, atol=2e-2 * np.abs(ref).max(), rtol=2e-2)
    # "silu" (an input normed already: the MoE lines' shared experts) == the plain GEMV, then silu_mul.cu
    no_norm, gate_up = poison(cp, (M + 1, I)), poison(cp, (M, 2 * I))
    gemm.gemv(xd, wid, no_norm[:M], "silu")
    gemm.gemv(xd, wid, gate_up, "bf16")
    silu((64,), (256,), (gate_up, parts, np.int32(I), total, np.int32(1)), stream=gemm.stream)
    gemm.stream.synchronize()
    got = no_norm.get()
    assert np.all(got[M] == 0x7FC1)
    np.testing.assert_array_equal(got[:M], parts.get())


@pytest.mark.parametrize("M", [1, 9, 40])
def test_products_by_a_weight_of_wider_rows(cp, gemm, M):
    """A weight that is the first K columns of wider rows (a view of wider rows; NaN past K, never
    read): gemv.cu's "bf16" and "norm_silu" (its row stride) and cuBLAS (lda) give the bits of the same
    weight stored alone, and a product over the whole rows reads every column."""
    from engine.executor.gpu_gemm import Gemm, interleave_gate_up

    rng = np.random.default_rng(M)
    I, K, extra = 64, 264, 40
    x, w = case(rng, M, 2 * I, K)
    wi = interleave_gate_up(w)
    wide = np.full((2 * I, K + extra), 0x7FC1, np.uint16)
    wide[:, :K] = wi
    alone, wided = dev(cp, wi), dev(cp, wide)
    view = wided[:, :K]
    nw = dev(cp, bits(1 + 0.1 * rng.standard_normal(K)))
    xd = dev(cp, x)
    blas = Gemm(gemm.stream)                       # no gemv rows: cuBLAS for every product
    try:
        for g in (gemm, blas):
            want, got = poison(cp, (M, 2 * I)), poison(cp, (M, 2 * I))
            g(xd, alone, want)
            g(xd, view, got)
            g.stream.synchronize()
            np.testing.assert_array_equal(got.get(), want.get())
        if M <= gemm.gemv_max_m:
            want, got = poison(cp, (M, I)), poison(cp, (M, I))
            gemm.gemv(xd, alone, want, "norm_silu", norm_w=nw, eps=1e-6)
            gemm.gemv(xd, view, got, "norm_silu", norm_w=nw, eps=1e-6)
            gemm.stream.synchronize()
            np.testing.assert_array_equal(got.get(), want.get())
        wide[:, K:] = bits(rng.standard_normal((2 * I, extra)) * 0.1)    # the whole rows: [x | y] · [W | B]ᵀ
        y = bits(rng.standard_normal((M, extra)))
        whole = poison(cp, (M, 2 * I))
        blas(dev(cp, np.concatenate([x, y], 1)), dev(cp, wide), whole)
        blas.stream.synchronize()
        close(whole.get(), matmul(f32(np.concatenate([x, y], 1)), wide))
    finally:
        blas.close()


def test_gemv_rejects_unknown_variant(cp, gemm):
    x, w = cp.zeros((1, 64), np.uint16), cp.zeros((16, 64), np.uint16)
    with pytest.raises(ValueError, match="variant"):
        gemm.gemv(x, w, cp.zeros((1, 16), np.uint16), "gelu")


@pytest.mark.parametrize("M", [1, 8, 16])
def test_pdl_chain_in_graph_equals_plain_launches(cp, gemm, M):
    """A decoder-like chain (norm GEMV -> residual GEMV -> norm GEMV -> SiLU·up -> residual GEMV, 6 times, each
    reading the one before) captured with programmatic dependent launches replays bit-identical to the
    same kernels launched plainly: a kernel reading before its predecessor finished would differ."""
    rng = np.random.default_rng(M)
    H, I, eps = 1024, 2816, 1e-6
    layers = [tuple(dev(cp, a) for a in (bits(1 + 0.1 * rng.standard_normal(H)), bits(rng.standard_normal((H, H)) * H ** -0.5),
                                         bits(rng.standard_normal((2 * I, H)) * H ** -0.5),
                                         bits(rng.standard_normal((H, I)) * I ** -0.5)))
              for _ in range(6)]
    x0 = dev(cp, bits(rng.standard_normal((M, H))))
    r, h, gu = cp.empty((M, H), np.uint16), cp.empty((M, H), np.uint16), cp.empty((M, 2 * I), np.uint16)
    act = cp.empty((M, I), np.uint16)
    s = gemm.stream
    silu = kernel("silu_mul", "silu_mul")

    def chain(pdl):
        cp.cuda.runtime.memcpyAsync(r.data.ptr, x0.data.ptr, r.nbytes, cp.cuda.runtime.memcpyDeviceToDevice, s.ptr)
        for nw, wo, wgu, wd in layers:
            gemm.gemv(r, wo, h, "norm", norm_w=nw, eps=eps, pdl=pdl)
            gemm.gemv(h, wo, r, "res", res_in=r, pdl=pdl)
            gemm.gemv(r, wgu, gu, "norm", norm_w=nw, eps=eps, pdl=pdl)
            launch(silu, (8,), (256,), (gu, act, np.int32(I), np.int64(M * I // 8), np.int32(0)), s, pdl=pdl)
            gemm.gemv(act, wd, r, "res", res_in=r, pdl=pdl)

    chain(False)
    s.synchronize()
    plain = r.get()
    chain(True)                             # eager PDL launches, then the same captured
    s.synchronize()
    np.testing.assert_array_equal(r.get(), plain)
    s.begin_capture()
    chain(True)
    graph = s.end_capture()
    for _ in range(3):
        r.fill(0)
        graph.launch(stream=s)
        s.synchronize()
        np.testing.assert_array_equal(r.get(), plain)


@pytest.mark.parametrize("M,N,K,in_place", [(1, 2560, 4096, True), (3, 2560, 9728, False), (8, 4096, 4096, True),
                                             (40, 256, 768, True), (100, 2560, 9728, True)])
def test_splitk_rms_norm_residual_equals_reduce_then_norm(cp, M, N, K, in_place):
    """The CuTe GEMM's split partials reduced with the residual add and the next RMSNorm in one
    kernel (the decode layer's add_linear_norm) give the same bits as the split-K reduction into
    the residual followed by rms_norm_residual, and the residual stream agrees with numpy."""
    from engine.executor.gpu_ops import splitk_norm_threads
    from openinfer_kernels import cute

    if not cute.available():
        pytest.skip(f"CuTe kernels unavailable: {cute.available().reason}")
    cute.init()
    rng = np.random.default_rng(M * 7 + N + K)
    x, w = case(rng, M, N, K)
    res, nw, eps = bits(rng.standard_normal((M, N))), bits(1 + 0.1 * rng.standard_normal(N)), 1e-6
    stream = cp.cuda.Stream(non_blocking=True)
    dx, dw, dnw = dev(cp, x), dev(cp, w), dev(cp, nw)
    cute.reserve_workspace(M, [(N, K)])
    cp.cuda.Device().synchronize()
    part = cute.gemm_partials(dx, dw, stream, residual=True, prefetch_weights=True)
    assert part is not None and part.shape[1:] == (M, N) and part.shape[0] > 1
    h_in = dev(cp, res)
    h_out = h_in if in_place else poison(cp, (M, N))
    normed = poison(cp, (M + 1, N))
    cp.cuda.Device().synchronize()  # the uploads and fills ran on the default stream
    kernel("rms_norm", "splitk_rms_norm_residual")(
        (M,), (splitk_norm_threads(N),), (np.uint64(part.ptr), np.int32(part.shape[0]), np.int64(M * N), h_in, dnw, normed, h_out,
                       np.int32(N), np.float32(eps)), stream=stream)
    h_ref, normed_ref = dev(cp, res), poison(cp, (M, N))
    cp.cuda.Device().synchronize()
    cute.gemm(dx, dw, h_ref, stream, residual=h_ref)
    kernel("rms_norm", "rms_norm_residual")((M,), (256,), (h_ref, np.uint64(0), dnw, normed_ref, h_ref, np.int32(N),
                                                           np.float32(eps)), stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(h_out.get(), h_ref.get())
    np.testing.assert_array_equal(normed.get()[:M], normed_ref.get())
    assert np.all(normed.get()[M] == 0x7FC1)
    close(h_out.get(), matmul(f32(x), w) + f32(res))


@pytest.mark.parametrize("M,I,K", [(2, 9728, 2560), (33, 12288, 4096), (96, 9728, 2560), (100, 12288, 4096),
                                   (5, 6008, 1032), (70, 4104, 264)])
def test_cute_swiglu_equals_gemm_then_silu_mul(cp, M, I, K):
    """The CuTe GEMM's SiLU·up twin (the decode MLP's norm_swiglu at M <= 128) gives the bits of the
    plain planned GEMM followed by silu_mul.cu in interleaved mode, and agrees with numpy on the
    un-interleaved weight."""
    from engine.executor.gpu_gemm import interleave_gate_up
    from openinfer_kernels import cute

    if not cute.available():
        pytest.skip(f"CuTe kernels unavailable: {cute.available().reason}")
    cute.init()
    rng = np.random.default_rng(M * 5 + I + K)
    x, w = case(rng, M, 2 * I, K)
    stream = cp.cuda.Stream(non_blocking=True)
    dx, dwi = dev(cp, x), dev(cp, interleave_gate_up(w))
    fused, gate_up, parts = poison(cp, (M + 1, I)), poison(cp, (M, 2 * I)), poison(cp, (M, I))
    cp.cuda.Device().synchronize()  # the uploads and fills ran on the default stream
    assert cute.gemm_swiglu(dx, dwi, fused[:M], stream, prefetch_weights=True)
    cute.gemm(dx, dwi, gate_up, stream, prefetch_weights=True)
    kernel("silu_mul", "silu_mul")((64,), (256,), (gate_up, parts, np.int32(I), np.int64(M * I // 8), np.int32(1)),
                                   stream=stream)
    stream.synchronize()
    got = fused.get()
    assert np.all(got[M] == 0x7FC1)
    np.testing.assert_array_equal(got[:M], parts.get())
    h = rb(matmul(f32(x), w))
    ref = silu_ref(h[:, :I], h[:, I:])
    np.testing.assert_allclose(f32(got[:M]), ref, atol=2e-2 * np.abs(ref).max(), rtol=2e-2)
