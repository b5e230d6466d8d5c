"""CuTe kernels on the CPU: the AOT build, its manifest and cache, the ctypes ABI, the launcher's checks."""
import ctypes
import json
import subprocess
import sys

import numpy as np
import pytest

from openinfer_kernels.cute.attention import ATTENTION_KERNELS
from openinfer_kernels.cute.configs import (FP8_GEMM_VARIANTS, GEMM_VARIANTS, REDUCE_NAME, REDUCE_RESIDUAL_NAME,
                                            plan_fp8_gemm)
from openinfer_kernels.cute.gemm import (DeviceTensor, as_device_tensor, check_fp8_args, check_gemm_args,
                                         check_grouped_args)
from openinfer_kernels.cute.moe import group_by_expert
from openinfer_kernels.cute.library import KernelLaunchError, Library, TensorArg, _tensor_struct

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass", reason="CuTe DSL not installed")
    out = tmp_path_factory.mktemp("cute_build")
    first = subprocess.run([sys.executable, "-m", "openinfer_kernels.cute.build", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    return out, first.stdout


def test_build_writes_library_and_manifest(built):
    out, log = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["arch"] == "sm_90a" and manifest["dsl_version"] == "4.8.1"
    names = {v.name for v in GEMM_VARIANTS + FP8_GEMM_VARIANTS} | {REDUCE_NAME, REDUCE_RESIDUAL_NAME, *ATTENTION_KERNELS}
    assert {"varlen_attention", "varlen_attention_ws", "varlen_attention_ws_d64"} <= set(ATTENTION_KERNELS)
    assert set(manifest["kernels"]) == names
    assert log.count("compiled ") == len(names)
    for name, info in manifest["kernels"].items():
        kinds = [p["kind"] for p in info["params"]]
        assert kinds[-2:] == ["stream", "ret"] and info["num_args"] == len(kinds), name
        assert (out / "obj" / f"{name}.{info['hash']}.o").is_file()
    lib = ctypes.CDLL(str(out / manifest["library"]))  # loads without a GPU: only libc is needed
    for info in manifest["kernels"].values():
        assert getattr(lib, info["symbol"])
        assert getattr(lib, f"_mlir_{info['prefix']}_cuda_init")
    deps = subprocess.run(["ldd", str(out / manifest["library"])], capture_output=True, text=True).stdout
    assert "libcuda" not in deps and "libcudart" not in deps, deps


def test_unchanged_kernels_are_not_rebuilt(built):
    out, _ = built
    before = json.loads((out / "manifest.json").read_text())
    again = subprocess.run([sys.executable, "-m", "openinfer_kernels.cute.build", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "compiled " not in again.stdout and "up to date" in again.stdout
    after = json.loads((out / "manifest.json").read_text())
    assert after["library_sha256"] == before["library_sha256"]


def test_library_loads_manifest_without_gpu(built):
    out, _ = built
    lib = Library(out)
    for v in GEMM_VARIANTS:
        assert lib[v.name].structs[0].__name__ == "Tensor_3_2"
        assert len(lib[v.name].structs) == (4 if v.grouped or v.residual else 3)
        scalars = [p["name"] for p in lib[v.name].params if p["kind"] == "int32"]
        assert scalars == ["b_early"], (v.name, lib[v.name].params)
    for v in FP8_GEMM_VARIANTS:  # a, b, out (M, N, L), then sfa (M, K/128) MN-major and sfb (N/128, K/128)
        params = lib[v.name].params
        assert [p["name"] for p in params] == ["a", "b", "c", "sfa", "sfb", "b_early", "stream", "ret"], v.name
        assert [s.__name__ for s in lib[v.name].structs] == ["Tensor_3_2"] * 3 + ["Tensor_2_1"] * 2
    with pytest.raises(KeyError, match="not in the manifest"):
        lib["gemm_nope"]


def test_kernel_call_checks_argument_kinds_before_launching(built):
    out, _ = built
    kernel = Library(out)["gemm_bf16_128x128_c1x1"]
    t = TensorArg(0, (1, 8, 1), (8, 8))
    with pytest.raises(TypeError, match="takes 4 arguments"):
        kernel(t, t, t, stream=0)
    with pytest.raises(TypeError, match="b_early must be an int"):
        kernel(t, t, t, t, stream=0)
    with pytest.raises(TypeError, match="must be a TensorArg"):
        kernel(t, 1, t, 0, stream=0)


def test_content_hash_tracks_the_variant():
    pytest.importorskip("cutlass", reason="CuTe DSL not installed")
    from openinfer_kernels.cute.build import content_hash

    assert content_hash("x", "a") == content_hash("x", "a")
    assert content_hash("x", "a") != content_hash("x", "b")


def test_build_hash_covers_every_kernel_module():
    """Each kernel family's hashed sources hold every module of this package that its kernel file
    imports, transitively (the GEMM's epilogue mixin once was not, so an edit there rebuilt nothing);
    configs is covered by the variant's repr."""
    import ast
    import pathlib

    pytest.importorskip("cutlass", reason="CuTe DSL not installed")
    from openinfer_kernels.cute.build import SOURCES

    here = pathlib.Path(__file__).resolve().parents[2] / "openinfer_kernels" / "cute"

    def imported(name, seen):
        for node in ast.walk(ast.parse((here / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in ("configs", None):
                dep = f"{node.module}.py"
                if dep not in seen:
                    seen.add(dep)
                    imported(dep, seen)
        return seen

    for family, sources in SOURCES.items():
        assert imported(sources[0], {sources[0]}) <= set(sources), family


def test_parse_header_reads_entry_and_tensors():
    from openinfer_kernels.cute.build import parse_header

    header = """
typedef struct {
    void *data;
    int32_t dynamic_shapes[2];
    int64_t dynamic_strides[1];
} red_Tensor_out_t;
void _mlir_red__mlir_ciface_fn_x(void **args, int32_t num_args);
    void *args[3] = {
        out, &stream,
        &ret
    };"""
    info = parse_header(header)
    assert info["symbol"] == "_mlir_red__mlir_ciface_fn_x" and info["num_args"] == 3
    assert info["params"][0] == {"name": "out", "kind": "tensor", "shapes": 2, "strides": 1}
    assert [p["kind"] for p in info["params"][1:]] == ["stream", "ret"]


def test_tensor_struct_matches_c_layout():
    # struct { void *data; int32_t shapes[3]; int64_t strides[2]; } is 8 + 12 + 4 (pad) + 16 bytes
    s = _tensor_struct(3, 2)
    assert ctypes.sizeof(s) == 40 and s.strides.offset == 24
    assert ctypes.sizeof(_tensor_struct(2, 1)) == 24


def test_missing_build_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m openinfer_kernels.cute.build"):
        Library(tmp_path)


class FakeArray:
    def __init__(self, shape, typestr="<u2", ptr=0x10000, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


def _args(m=4, n=64, k=128, **over):
    a = over.get("a", FakeArray((m, k)))
    b = over.get("b", FakeArray((n, k)))
    out = over.get("out", FakeArray((m, n)))
    return [as_device_tensor(x, w) for x, w in ((a, "a"), (b, "b"), (out, "out"))]


def test_launcher_accepts_good_arguments():
    assert check_gemm_args(*_args()) == (4, 64, 128)
    raw = DeviceTensor(0x20000, (1, 16), (16, 1))
    assert as_device_tensor(raw, "a") is raw


@pytest.mark.parametrize("over,message", [
    ({"a": FakeArray((4, 128), typestr="<f2")}, "a must be bfloat16"),
    ({"b": FakeArray((64, 120))}, r"b has shape \(64, 120\)"),
    ({"out": FakeArray((5, 64))}, r"out has shape \(5, 64\)"),
    ({"a": FakeArray((4, 128), ptr=0x10008)}, "16-byte aligned"),
    ({"a": FakeArray((4, 128), strides=(260, 2))}, "not a multiple of 8"),
    ({"a": FakeArray((4, 128), strides=(2, 8))}, "contiguous"),
    ({"a": FakeArray((4, 128, 1))}, "2-D"),
])
def test_launcher_rejects_bad_arguments(over, message):
    with pytest.raises((TypeError, ValueError), match=message):
        check_gemm_args(*_args(**over))


def test_launcher_rejects_unaligned_sizes():
    with pytest.raises(ValueError, match="K=12"):
        check_gemm_args(*_args(k=12))
    with pytest.raises(ValueError, match="N=60"):
        check_gemm_args(*_args(n=60))
    with pytest.raises(TypeError, match="device array"):
        as_device_tensor([1, 2], "a")


def _fp8_args(m=4, n=64, k=256, **over):
    arrays = {"a": FakeArray((m, k), "|u1"), "a_scales": FakeArray((k // 128, m + 2), "<f4"),
              "b": FakeArray((n, k), "|u1"), "b_scales": FakeArray((-(-n // 128), k // 128), "<f4"),
              "out": FakeArray((m, n))}
    arrays.update(over)
    return [as_device_tensor(a, name) for name, a in arrays.items()]


def test_fp8_launcher_checks():
    assert check_fp8_args(*_fp8_args()) == (4, 64, 256)
    for over, message in [
        ({"a": FakeArray((4, 256))}, "a must be e4m3 bytes"),
        ({"b": FakeArray((64, 128), "|u1")}, r"b must be e4m3 bytes \(uint8\) \[64, 256\]"),
        ({"a_scales": FakeArray((2, 3), "<f4")}, r"a_scales must be float32 \[2, >= 4\]"),
        ({"b_scales": FakeArray((2, 2), "<f4")}, r"b_scales must be float32 \[1, 2\]"),
        ({"out": FakeArray((4, 64), "<f4")}, "out must be bfloat16"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            check_fp8_args(*_fp8_args(**over))
    with pytest.raises(ValueError, match="multiple of 128"):
        check_fp8_args(*_fp8_args(k=200))
    with pytest.raises(ValueError, match="multiple of 128"):
        check_fp8_args(*_fp8_args(n=60))


def test_fp8_plan_streams_small_m_and_fills_waves():
    assert plan_fp8_gemm(1, 6144, 4096).name == "gemm_fp8_64x128_c1x1_ws"
    assert plan_fp8_gemm(4096, 4096, 4096).name == "gemm_fp8_128x128_c2x1_ws"   # 32 M-tiles in pairs
    assert plan_fp8_gemm(1100, 12288, 4096).name == "gemm_fp8_128x128_c2x1_ws"   # 9: one padded row of 10
    assert plan_fp8_gemm(300, 24576, 4096).name == "gemm_fp8_128x128_c1x1_ws"    # 3: a pair would pad a row
    assert plan_fp8_gemm(256, 2048, 4096).name == "gemm_fp8_128x64_c1x1_ws"   # 32 wide tiles, 64 narrow


def test_available_reports_missing_build(monkeypatch, tmp_path):
    import openinfer_kernels.cute as cute
    from openinfer_kernels.cute import library

    monkeypatch.setattr(library, "DEFAULT_DIR", tmp_path)
    monkeypatch.setattr(cute, "_runner", None)
    avail = cute.available()
    assert not avail and "openinfer_kernels.cute.build" in avail.reason


def test_group_by_expert_pads_each_expert_to_whole_tiles():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 6, size=(50, 4))
    g = group_by_expert(ids, 8, tile_m=64)
    rows, experts = g.rows.reshape(-1), ids.reshape(-1)
    assert len(set(rows.tolist())) == rows.size  # every assignment has its own row
    assert np.array_equal(g.tile_expert[rows // 64], experts)  # the row's tile belongs to its expert
    assert np.array_equal(g.counts, np.bincount(experts, minlength=8))
    assert g.padded_rows == 64 * int(sum(-(-c // 64) for c in g.counts))
    for e in range(8):  # stable: token order is kept inside an expert's group
        mine = rows[experts == e]
        assert np.all(np.diff(mine) == 1) and (mine.size == 0 or mine[0] % 64 == 0)


@pytest.mark.parametrize("ids,message", [
    (np.array([1, 2]), "tokens, top_k"), (np.array([[0, 9]]), r"\[0, 8\)")])
def test_group_by_expert_rejects_bad_ids(ids, message):
    with pytest.raises(ValueError, match=message):
        group_by_expert(ids, 8)


def test_grouped_launcher_checks():
    a, out = FakeArray((128, 64)), FakeArray((128, 32))
    w = FakeArray((4, 32, 64))
    te = FakeArray((2,), typestr="<i4")
    args = [as_device_tensor(x, n) for x, n in ((a, "a"), (w, "w"), (te, "t"), (out, "out"))]
    assert check_grouped_args(*args) == (128, 32, 64, 4, 64)
    bad = as_device_tensor(FakeArray((3,), typestr="<i4"), "t")
    with pytest.raises(ValueError, match="rows per tile"):
        check_grouped_args(args[0], args[1], bad, args[3])
    with pytest.raises(TypeError, match="int32"):
        check_grouped_args(args[0], args[1], as_device_tensor(FakeArray((2,), typestr="<i8"), "t"), args[3])


def test_attention_work_lists_every_tile_longest_first():
    from openinfer_kernels.cute.attention import attention_work

    lengths = np.array([5, 0, 300, 128, 129])
    work = attention_work(np.concatenate([[0], np.cumsum(lengths)]))
    assert work.dtype == np.int32 and work.shape == (1 + 0 + 3 + 1 + 2, 2)
    expect = {(b, t) for b, n in enumerate(lengths) for t in range(-(-n // 128))}
    assert {tuple(r) for r in work.tolist()} == expect
    assert work[0].tolist() == [2, 2]  # longest sequence, its last (costliest) tile first
    with pytest.raises(ValueError, match="prefix sum"):
        attention_work(np.array([0, 5, 3]))


def _attn_args(tq=10, tk=12, hq=8, hkv=2, **over):
    from openinfer_kernels.cute.attention import check_attention_args

    arrays = {
        "q": FakeArray((tq, hq, 128)), "k": FakeArray((tk, hkv, 128)), "v": FakeArray((tk, hkv, 128)),
        "o": FakeArray((tq, hq, 128)), "cu_q": FakeArray((3,), "<i4"), "cu_k": FakeArray((3,), "<i4"),
        "work": FakeArray((4, 2), "<i4"),
    }
    arrays.update(over)
    check_attention_args(*(as_device_tensor(a, n) for n, a in arrays.items()))


def test_attention_launcher_checks():
    _attn_args()
    for over, message in [
        ({"q": FakeArray((10, 8, 64))}, r"k must be \[tokens, heads, 64\]"),
        ({"k": FakeArray((12, 3, 128)), "v": FakeArray((12, 3, 128))}, "multiple of key/value heads"),
        ({"v": FakeArray((11, 2, 128))}, "v must match k"),
        ({"o": FakeArray((10, 8, 128), "<f2")}, "o must be bfloat16"),
        ({"cu_k": FakeArray((4,), "<i4")}, r"\[batch \+ 1\]"),
        ({"work": FakeArray((4, 3), "<i4")}, "attention_work"),
        ({"cu_q": FakeArray((3,), "<i8")}, "int32"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            _attn_args(**over)


def _attn_arrays(d=128, dk=None):
    dk = dk or d
    return [FakeArray((10, 8, d)), FakeArray((12, 2, dk)), FakeArray((12, 2, dk)), FakeArray((10, 8, d)),
            FakeArray((3,), "<i4"), FakeArray((3,), "<i4"), FakeArray((4, 2), "<i4")]


def test_attention_launcher_checks_head_dims():
    from openinfer_kernels.cute.attention import check_attention_args

    assert check_attention_args(*(as_device_tensor(a, "x") for a in _attn_arrays(64))) == 64
    assert check_attention_args(*(as_device_tensor(a, "x") for a in _attn_arrays(128))) == 128
    with pytest.raises(ValueError, match=r"k must be \[tokens, heads, 64\]"):
        check_attention_args(*(as_device_tensor(a, "x") for a in _attn_arrays(64, 128)))
    with pytest.raises(ValueError, match=r"q must be \[tokens, heads, 128\]"):
        check_attention_args(*(as_device_tensor(a, "x") for a in _attn_arrays(96)))


class _NoRunner:
    def ensure_loaded(self):
        raise AssertionError("the launcher must reject the call before touching the library")


def test_attention_launcher_picks_only_a_matching_verified_kernel(monkeypatch):
    from openinfer_kernels.cute import attention

    assert set(attention.DEFAULT_KERNEL.values()) <= set(attention.ATTENTION_KERNELS)
    for d, name in attention.DEFAULT_KERNEL.items():
        assert attention.ATTENTION_BY_NAME[name].head_dim == d
    with pytest.raises(ValueError, match="unknown attention kernel 'fa9'"):
        attention.varlen_attention(_NoRunner(), *_attn_arrays(), kernel="fa9")
    with pytest.raises(ValueError, match="varlen_attention_ws_d64 is for head_dim 64, the tensors have 128"):
        attention.varlen_attention(_NoRunner(), *_attn_arrays(128), kernel="varlen_attention_ws_d64")
    monkeypatch.setattr(attention, "DEFAULT_KERNEL", {128: "varlen_attention_ws"})
    with pytest.raises(ValueError, match="no attention kernel verified for head_dim 64"):
        attention.varlen_attention(_NoRunner(), *_attn_arrays(64))


class _QueuedInputsCupy:
    """Just enough of CuPy for ``bench.kernels.graph_time_us``: the default stream holds the
    inputs' queued work (random data, cu_seqlens, work-list copies), which only a host wait on
    that stream completes; a launch on another stream before that reads unfinished inputs."""

    def __init__(self):
        import types

        cupy = self

        class Stream:
            def __init__(self, non_blocking=False):
                self.pending = False
                self.graphs = []

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def begin_capture(self):
                self.capturing = True

            def end_capture(self):
                self.capturing = False
                return types.SimpleNamespace(launch=lambda stream: None)

        class Event:
            def __init__(self, **kw):
                self.stream = None

            def record(self, stream=None):
                self.stream = stream

            @property
            def done(self):
                if self.stream is Stream.null:
                    Stream.null.pending = False  # the host waited for the default stream's work
                return True

        Stream.null = Stream()
        Stream.null.pending = True
        self.stale_reads = 0
        self.cuda = types.SimpleNamespace(Stream=Stream, Event=Event, get_elapsed_time=lambda a, b: 1.0,
                                          get_current_stream=lambda: Stream.null)

        def launch(i, stream):
            assert stream is not Stream.null
            cupy.stale_reads += Stream.null.pending

        self.launch = launch


def test_benchmark_launches_only_after_its_inputs_are_made(monkeypatch):
    """The 16k-token attention benchmark hung: its cu_seqlens / work list were still being copied
    on the default stream (behind ~2 ms of random-input generation) when the kernel started on the
    timing stream, so it read garbage sequence lengths. The timing must wait for the inputs."""
    import bench.kernels as bench

    fake = _QueuedInputsCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert bench.graph_time_us(fake.launch, 1, "attention n=16384") == 1.0 / bench.GRAPH_LAUNCHES * 1e3
    assert fake.stale_reads == 0


def test_kernel_call_reuses_its_packed_arguments_and_reports_each_launch_error(built):
    """A repeated call packs nothing again (the engine's buffers do not move), yet every launch's
    return code is read afresh: a failure is reported even after a cached success."""
    import ctypes

    out, _ = built
    kernel = Library(out)["gemm_bf16_128x128_c1x1"]
    arrays, codes = [], [0, 0, 701, 0]

    def entry(array, nargs):
        arrays.append(ctypes.addressof(array))
        ret = ctypes.cast(array[nargs - 1], ctypes.POINTER(ctypes.c_int32))
        ret[0] = codes[len(arrays) - 1]

    kernel.entry = entry
    t = TensorArg(4096, (1, 8, 1), (8, 8))
    kernel(t, t, t, 0, stream=7)
    kernel(t, t, t, 0, stream=7)
    assert arrays[0] == arrays[1]
    with pytest.raises(KernelLaunchError, match="701"):
        kernel(t, t, t, 0, stream=7)
    kernel(t, t, t, 1, stream=7)  # other arguments: packed anew
    assert arrays[3] != arrays[0]
