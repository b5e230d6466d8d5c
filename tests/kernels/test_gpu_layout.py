"""The device weight layouts the GPU executor uploads (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest


def test_interleave_gate_up_pairs_gate_and_up_rows():
    """Block b of 16 rows holds gate rows 8b..8b+7 then up rows 8b..8b+7 (gemv.cu's SiLU·up layout)."""
    from engine.executor.gpu_gemm import interleave_gate_up

    I, H = 24, 3
    w = np.arange(2 * I * H, dtype=np.uint16).reshape(2 * I, H)
    wi = interleave_gate_up(w)
    for b in range(I // 8):
        np.testing.assert_array_equal(wi[16 * b:16 * b + 8], w[8 * b:8 * b + 8])
        np.testing.assert_array_equal(wi[16 * b + 8:16 * b + 16], w[I + 8 * b:I + 8 * b + 8])
    assert sorted(map(tuple, wi)) == sorted(map(tuple, w))
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave_gate_up(w[:40])


def test_prepare_cute_loads_the_kernels_and_sizes_the_workspace_for_every_weight():
    """Gemm.prepare_cute (run before graph capture): init, then one workspace reservation covering
    every distinct (N, K) weight shape for the rows the CuTe GEMM takes (at most cute_max_m);
    nothing when the CuTe path is off."""
    from types import SimpleNamespace

    from engine.executor.gpu_gemm import Gemm

    calls = []
    cute = SimpleNamespace(init=lambda: calls.append("init"), self_check=lambda: None,
                           reserve_workspace=lambda m, shapes, buffer: calls.append(("reserve", m, shapes, buffer)))
    shapes = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (6144, 2560)]
    arena_buffer = object()       # the executor's arena carve (gpu_gemm.cute_workspace_bytes)
    Gemm.prepare_cute(SimpleNamespace(cute=cute, cute_max_m=1 << 30, cute_workspace=arena_buffer), 512, shapes)
    assert calls == ["init", ("reserve", 512, [(2560, 4096), (2560, 9728), (6144, 2560), (19456, 2560)],
                              arena_buffer)]
    calls.clear()
    Gemm.prepare_cute(SimpleNamespace(cute=cute, cute_max_m=128, cute_workspace=None), 512, shapes)  # "auto"
    assert calls == ["init", ("reserve", 128, [(2560, 4096), (2560, 9728), (6144, 2560), (19456, 2560)], None)]
    calls.clear()
    Gemm.prepare_cute(SimpleNamespace(cute=None, cute_max_m=128, cute_workspace=None), 512, [(8, 8)])
    Gemm.prepare_cute(SimpleNamespace(cute=cute, cute_max_m=128, cute_workspace=None), 512, [])
    assert calls == []


def test_cute_takes_the_products_of_its_row_limit():
    """The GEMM library split of "auto": the CuTe GEMM up to cute_max_m rows, bf16 outputs only
    (logits stay on cuBLAS), and nothing where its library is missing."""
    from types import SimpleNamespace

    import numpy as np

    from engine.executor.gpu_gemm import Gemm

    bf16, f32 = np.zeros(1, np.uint16), np.zeros(1, np.float32)
    auto = SimpleNamespace(cute=object(), cute_max_m=128)
    assert Gemm.cute_serves(auto, 1, bf16) and Gemm.cute_serves(auto, 128, bf16)
    assert not Gemm.cute_serves(auto, 129, bf16) and not Gemm.cute_serves(auto, 1, f32)
    assert not Gemm.cute_serves(SimpleNamespace(cute=None, cute_max_m=128), 1, bf16)


def test_a_failing_cute_start_up_check_leaves_cublas_serving():
    """prepare_cute: a kernel load that fails, or a check product that comes out wrong, turns the
    CuTe GEMM off (cuBLAS serves) and says why, instead of failing requests later."""
    from types import SimpleNamespace

    from engine.executor.gpu_gemm import Gemm

    def fails(what):
        def raise_it(*_):
            raise RuntimeError(what)
        return raise_it

    for cute, why in ((SimpleNamespace(init=fails("no cluster launch"), reserve_workspace=None, self_check=None),
                       "no cluster launch"),
                      (SimpleNamespace(init=lambda: None, reserve_workspace=lambda m, shapes, buffer: None,
                                       self_check=fails("3x136x264 product: relative error 0.5")), "error 0.5")):
        g = SimpleNamespace(cute=cute, cute_max_m=128, cute_missing="", gemv_max_m=8, cute_workspace=None)
        Gemm.prepare_cute(g, 512, [(2560, 4096)])
        assert g.cute is None and why in g.cute_missing
        assert "cuBLAS" in Gemm.describe(g) and why in Gemm.describe(g)
