"""The CuTe GEMM launcher on the CPU, over a recording stand-in library: how far A is read, the
argument views it passes, weight prefetch, and the split-K partials it hands to a caller."""
import sys

import pytest

from openinfer_kernels.cute.configs import plan_gemm, split_count
from openinfer_kernels.cute.gemm import A_ROW_PAD, DeviceTensor, as_device_tensor, readable_rows


class _FakeCupyArray:
    """Just enough of a CuPy array: the array interface and ``data.mem`` (the allocation)."""

    def __init__(self, ptr, shape, alloc_ptr, alloc_size):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<u2", "data": (ptr, False), "strides": None}
        self.data = type("MemoryPointer", (), {"mem": type("Memory", (), {"ptr": alloc_ptr, "size": alloc_size})()})()


def test_a_rows_read_past_m_only_inside_the_allocation():
    k = 64
    row = k * 2
    # a 3-row view at the start of a 1000-row buffer: read to the next multiple of A_ROW_PAD
    a = as_device_tensor(_FakeCupyArray(1 << 20, (3, k), 1 << 20, 1000 * row), "a", reach=True)
    assert a.readable == 1000 * row
    assert readable_rows(a, 3, k, k) == A_ROW_PAD
    # a view starting at row 900: only the 100 rows left in the allocation
    a = as_device_tensor(_FakeCupyArray((1 << 20) + 900 * row, (3, k), 1 << 20, 1000 * row), "a", reach=True)
    assert readable_rows(a, 3, k, k) == 100
    # an exact allocation, a raw DeviceTensor, a foreign pointer: M itself
    a = as_device_tensor(_FakeCupyArray(1 << 20, (3, k), 1 << 20, 3 * row), "a", reach=True)
    assert readable_rows(a, 3, k, k) == 3
    assert readable_rows(DeviceTensor(1 << 20, (3, k), (k, 1)), 3, k, k) == 3
    a = as_device_tensor(_FakeCupyArray(1 << 30, (3, k), 1 << 20, 1000 * row), "a", reach=True)
    assert a.readable == 0 and readable_rows(a, 3, k, k) == 3
    # a strided view (row stride 2K): a row counts only when its K elements lie inside
    a = DeviceTensor(0, (5, k), (2 * k, 1), readable=(7 * 2 * k + k) * 2)
    assert readable_rows(a, 5, k, 2 * k) == 8


class _RecordingLibrary:
    """Stands in for the shared library: records each kernel call's name and arguments."""

    def __init__(self):
        self.calls = []

    def is_loaded(self, device: int) -> bool:
        return True

    def __getitem__(self, name):
        return lambda *args, stream: self.calls.append((name, args))


def test_launcher_describes_a_to_whole_tiles_and_the_output_to_m(monkeypatch):
    """A K pair at M = 193 (N 2560, K 4096) with A a view into a 1000-row allocation: the kernel
    sees A with 256 rows, the output with 193; from an exact allocation, A keeps 193."""
    import types

    from openinfer_kernels.cute.gemm import GemmRunner

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    m, n, k = 193, 2560, 4096
    assert plan_gemm(m, n, k).splits == 1
    lib = _RecordingLibrary()
    runner = GemmRunner(lib)
    w = DeviceTensor(1 << 40, (n, k), (k, 1))
    out = DeviceTensor(1 << 41, (m, n), (n, 1))
    for alloc_rows, a_rows in ((1000, A_ROW_PAD), (m, m)):
        a = _FakeCupyArray(1 << 30, (m, k), 1 << 30, alloc_rows * k * 2)
        runner(a, w, out, stream=7)
        name, (a_arg, _, out_arg, prefetch) = lib.calls[-1]
        assert name == plan_gemm(m, n, k).variant.name
        assert a_arg.shapes == (a_rows, k, 1) and a_arg.strides == (k, k * a_rows)
        assert out_arg.shapes == (m, n, 1)
    with pytest.raises(ValueError, match="a_rows"):
        runner(a, w, out, stream=7, a_rows=m - 1)


@pytest.fixture
def recording_runner(monkeypatch):
    """A GemmRunner over a _RecordingLibrary, with a stand-in CuPy (not capturing) and a 1 GiB
    stand-in workspace at address 1 << 42."""
    import types

    from openinfer_kernels.cute.gemm import GemmRunner

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0),
        runtime=types.SimpleNamespace(streamIsCapturing=lambda s: 0)))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    runner = GemmRunner(_RecordingLibrary())
    runner._workspace = types.SimpleNamespace(nbytes=1 << 30, data=types.SimpleNamespace(ptr=1 << 42))
    return runner, runner.library


def test_launcher_prefetches_weights_for_streams_only(recording_runner):
    """``prefetch_weights`` sets the kernels' b_early flag for the weight streams (64-row tiles, and
    one row of 128-row tiles at M <= 128) and nowhere else: on 128-row tiles at larger M and on
    192-row tiles it was measured slower."""
    runner, lib = recording_runner
    n, k = 6144, 2560
    w = DeviceTensor(1 << 40, (n, k), (k, 1))
    for m, streams in ((1, True), (64, True), (96, True), (160, False), (512, False)):
        a = DeviceTensor(1 << 30, (m, k), (k, 1))
        out = DeviceTensor(1 << 41, (m, n), (n, 1))
        tile_m = plan_gemm(m, n, k).variant.tile_m
        assert (tile_m == 64 or (tile_m == 128 and m <= 128)) == streams
        for prefetch in (False, True):
            runner(a, w, out, stream=7, prefetch_weights=prefetch)
            name, args = lib.calls[-1]
            assert name == plan_gemm(m, n, k).variant.name and args[-1] == int(prefetch and streams)


def test_partials_launch_only_the_split_gemm(recording_runner):
    """``GemmRunner.partials``: where the residual plan splits in K (4B o_proj at M = 8: four
    splits), only the f32 GEMM runs, into the workspace, and the partials come back as
    ``[S, M, N]`` float32 slices of M·N; where it does not split (qkv), nothing is launched."""
    runner, lib = recording_runner
    m, n, k = 8, 2560, 4096
    plan = plan_gemm(m, n, k, residual=True)
    assert plan.splits > 1 and plan.variant.out == "f32"
    a = DeviceTensor(1 << 30, (m, k), (k, 1))
    part = runner.partials(a, DeviceTensor(1 << 40, (n, k), (k, 1)), stream=7, residual=True, prefetch_weights=True)
    assert [name for name, _ in lib.calls] == [plan.variant.name]
    _, (_, _, partial_arg, prefetch) = lib.calls[-1]
    s = split_count(k, plan.splits)
    assert part.shape == (s, m, n) and part.strides == (m * n, n, 1) and part.dtype == "float32"
    assert part.ptr == partial_arg.data == 1 << 42 and partial_arg.shapes == (m, n, s) and prefetch == 1
    assert plan_gemm(m, 6144, 2560, residual=True).splits == 1
    assert runner.partials(DeviceTensor(1 << 30, (m, 2560), (2560, 1)),
                           DeviceTensor(1 << 40, (6144, 2560), (2560, 1))) is None
    assert len(lib.calls) == 1
    with pytest.raises(ValueError, match="multiple of 8"):
        runner.partials(DeviceTensor(1 << 30, (m, 100), (104, 1)), DeviceTensor(1 << 40, (n, 100), (104, 1)))


def test_swiglu_launches_the_silu_twin_or_nothing(recording_runner):
    """``GemmRunner.swiglu``: 4B gate_up at M = 8 runs the SiLU·up twin of its planned tile, the
    output described as [M, N/2]; a shape whose plan has no twin (N = 3072 at M = 8: 64x48 tiles)
    launches nothing and says so; a wrong output shape or an N that is not a multiple of 16 is refused."""
    from openinfer_kernels.cute.configs import silu_twin

    runner, lib = recording_runner
    m, n, k = 8, 19456, 2560
    a, w = DeviceTensor(1 << 30, (m, k), (k, 1)), DeviceTensor(1 << 40, (n, k), (k, 1))
    assert runner.swiglu(a, w, DeviceTensor(1 << 41, (m, n // 2), (n // 2, 1)), stream=7, prefetch_weights=True)
    name, (_, b_arg, out_arg, prefetch) = lib.calls[-1]
    plan = plan_gemm(m, n, k)
    assert name == silu_twin(plan).name == "gemm_bf16_64x160_c1x1_ws_silu_a16"  # M <= 16: the 16-row A tile
    assert out_arg.shapes == (m, n // 2, 1) and b_arg.shapes == (n, k, 1) and prefetch == 1
    assert silu_twin(plan_gemm(m, 3072, 576)) is None
    assert not runner.swiglu(DeviceTensor(1 << 30, (m, 576), (576, 1)), DeviceTensor(1 << 40, (3072, 576), (576, 1)),
                             DeviceTensor(1 << 41, (m, 1536), (1536, 1)))
    assert len(lib.calls) == 1
    with pytest.raises(ValueError, match=r"shape \(8, 19456\), expected \(8, 9728\)"):
        runner.swiglu(a, w, DeviceTensor(1 << 41, (m, n), (n, 1)))
    with pytest.raises(ValueError, match="multiple of 16"):
        runner.swiglu(a, DeviceTensor(1 << 40, (n - 8, k), (k, 1)), DeviceTensor(1 << 41, (m, n // 2 - 4), (n, 1)))


def test_a16_tiles_only_up_to_16_rows(recording_runner):
    """At M <= 16 the plan's 64-row tiles take their 16-row A twin, from 17 rows the full tile; an
    explicit a16 plan for more rows than it loads is refused before anything launches."""
    from openinfer_kernels.cute.configs import A_BOX_ROWS, GemmPlan

    runner, lib = recording_runner
    n, k = 6144, 2560
    assert plan_gemm(A_BOX_ROWS, n, k).variant.a_rows == A_BOX_ROWS
    assert plan_gemm(A_BOX_ROWS + 1, n, k).variant.a_rows == 0
    assert plan_gemm(8, 2560, 4096, residual=True).variant.a_rows == A_BOX_ROWS  # split plans too
    boxed = plan_gemm(8, n, k)
    m = A_BOX_ROWS + 1
    with pytest.raises(ValueError, match="serves at most 16 rows"):
        runner(DeviceTensor(1 << 30, (m, k), (k, 1)), DeviceTensor(1 << 40, (n, k), (k, 1)),
               DeviceTensor(1 << 41, (m, n), (n, 1)), plan=GemmPlan(boxed.variant))
    assert lib.calls == []
