"""Loads the prebuilt ``libopeninfer_cute.so`` with ctypes and calls its kernels (no DSL at run time).

The manifest (written by ``openinfer_kernels.cute.build``) names each kernel's entry symbol and argument list.
Every kernel module is initialised and loaded onto each device once, in ``Library.load`` — do it
before capturing a CUDA graph. A call packs each tensor as ``{void *data; int32 shapes[k];
int64 strides[j]}`` (only the dynamic modes), then the stream, then an ``int32`` return code, and
hands the entry an array of pointers to them (int32 scalars, like the GEMMs' ``b_early``, as
``int32`` values in their place). The exported host code builds the TMA descriptors and
launches with ``cudaLaunchKernelEx`` on the given stream, so launches are graph-capturable.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("OPENINFER_CUTE_DIR", Path(__file__).resolve().parent / "build"))


PACKED_CALLS = 1024  # packed argument arrays kept per kernel (then the cache starts over)


class KernelLaunchError(RuntimeError):
    """A CUDA error reported by an exported kernel's host code."""


@dataclass(frozen=True)
class TensorArg:
    """A device tensor as the exported entry sees it: address plus its dynamic shape and strides."""

    data: int
    shapes: tuple[int, ...]
    strides: tuple[int, ...]


def _tensor_struct(n_shapes: int, n_strides: int) -> type[ctypes.Structure]:
    fields = [("data", ctypes.c_void_p)]
    if n_shapes:
        fields.append(("shapes", ctypes.c_int32 * n_shapes))
    if n_strides:
        fields.append(("strides", ctypes.c_int64 * n_strides))
    return type(f"Tensor_{n_shapes}_{n_strides}", (ctypes.Structure,), {"_fields_": fields})


class Kernel:
    """One exported entry point; ``__call__(*args, stream)`` launches it."""

    def __init__(self, lib: ctypes.CDLL, name: str, info: dict):
        self.name = name
        self.params = info["params"]
        self.entry = getattr(lib, info["symbol"])
        self.entry.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self.entry.restype = None
        self.structs = [_tensor_struct(p["shapes"], p["strides"]) for p in self.params if p["kind"] == "tensor"]
        self.init = getattr(lib, f"_mlir_{info['prefix']}_cuda_init")
        self.load_to_device = getattr(lib, f"_mlir_{info['prefix']}_cuda_load_to_device")
        self._packed: dict = {}  # (args, stream) -> (argument array, count, return code)
        self._module = ctypes.c_void_p()
        self._module_ptr = ctypes.c_void_p(ctypes.addressof(self._module))
        self._initialised = False

    def load(self, devices: list[int]) -> None:
        ret = ctypes.c_int32(0)
        if not self._initialised:
            args = (ctypes.c_void_p * 2)(ctypes.addressof(self._module_ptr), ctypes.addressof(ret))
            self.init(args)
            _check(ret.value, f"{self.name}: module init")
            self._initialised = True
        for dev in devices:
            dev_id = ctypes.c_int32(dev)
            args = (ctypes.c_void_p * 3)(ctypes.addressof(self._module_ptr), ctypes.addressof(dev_id),
                                        ctypes.addressof(ret))
            self.load_to_device(args)
            _check(ret.value, f"{self.name}: module load on device {dev}")

    def __call__(self, *args: TensorArg | int, stream: int) -> None:
        """Launch with the entry's arguments in order: TensorArg for tensors, int for int32 scalars.
        The packed argument array of a call is kept, keyed by its arguments, so a repeated call (the
        engine's buffers do not move) costs one dictionary lookup before the launch."""
        key = (args, stream)
        packed = self._packed.get(key)
        if packed is None:
            if len(self._packed) >= PACKED_CALLS:
                self._packed.clear()
            packed = self._packed[key] = self._pack(args, stream)
        array, nargs, ret = packed
        ret.value = 0
        self.entry(array, nargs)
        _check(ret.value, f"{self.name} launch")

    def _pack(self, args: tuple, stream: int) -> tuple:
        """The ctypes argument array for one call: pointers to each packed argument, the stream and
        the return code (the array keeps its targets alive)."""
        params = [p for p in self.params if p["kind"] in ("tensor", "int32")]
        if len(args) != len(params):
            raise TypeError(f"{self.name} takes {len(params)} arguments "
                            f"({', '.join(p['name'] for p in params)}), got {len(args)}")
        keep, structs = [], iter(self.structs)
        for arg, param in zip(args, params):
            if param["kind"] == "int32":
                if not isinstance(arg, int):
                    raise TypeError(f"{self.name}: {param['name']} must be an int, got {type(arg).__name__}")
                keep.append(ctypes.c_int32(arg))
                continue
            if not isinstance(arg, TensorArg):
                raise TypeError(f"{self.name}: {param['name']} must be a TensorArg, got {type(arg).__name__}")
            s = next(structs)()
            s.data = arg.data
            if arg.shapes:
                s.shapes[:] = arg.shapes
            if arg.strides:
                s.strides[:] = arg.strides
            keep.append(s)
        stream_v = ctypes.c_void_p(stream)
        ret = ctypes.c_int32(0)
        keep += [stream_v, ret]
        array = (ctypes.c_void_p * len(keep))(*(ctypes.addressof(s) for s in keep))
        array._keep = keep
        return array, len(keep), ret


def _check(code: int, what: str) -> None:
    if code != 0:
        raise KernelLaunchError(f"{what} failed with CUDA error {code}")


class Library:
    """The shared library plus its manifest; kernels are looked up by manifest name."""

    def __init__(self, directory: Path | None = None):
        directory = Path(directory if directory is not None else DEFAULT_DIR)
        manifest_path = directory / "manifest.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"{manifest_path} missing: build the CuTe kernels with `python -m openinfer_kernels.cute.build`")
        self.manifest = json.loads(manifest_path.read_text())
        so_path = directory / self.manifest["library"]
        if not so_path.is_file():
            raise FileNotFoundError(f"{so_path} missing: rebuild with `python -m openinfer_kernels.cute.build`")
        self._lib = ctypes.CDLL(str(so_path))
        self.kernels = {name: Kernel(self._lib, name, info) for name, info in self.manifest["kernels"].items()}
        self._loaded: set[int] = set()
        self._lock = threading.Lock()

    def load(self, devices: list[int]) -> None:
        """Initialise every kernel module on the given devices (idempotent; not during capture)."""
        with self._lock:
            todo = [d for d in devices if d not in self._loaded]
            if not todo:
                return
            for kernel in self.kernels.values():
                kernel.load(todo)
            self._loaded.update(todo)

    def is_loaded(self, device: int) -> bool:
        return device in self._loaded

    def __getitem__(self, name: str) -> Kernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"kernel {name!r} is not in the manifest; rebuild with `python -m openinfer_kernels.cute.build`") from None


_OPENED: dict[Path, Library] = {}
_OPEN_LOCK = threading.Lock()


def open_library(directory: Path | None = None) -> Library:
    """The process-wide Library for a build directory (modules are initialised once per process)."""
    path = Path(directory if directory is not None else DEFAULT_DIR).resolve()
    with _OPEN_LOCK:
        if path not in _OPENED:
            _OPENED[path] = Library(path)
        return _OPENED[path]
