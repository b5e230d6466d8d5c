"""Kernel launches with programmatic dependent launch (PDL, Hopper and later).

A CuPy launch makes a kernel wait for the whole previous kernel on the stream: its blocks start only
after the last block of the previous one has finished and its writes are flushed, so every decode
kernel pays a ramp-up and a tail (a few µs each, over ~250 kernels per step). Launched with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, a kernel may start as soon as every block of
the previous one has run `griddepcontrol.launch_dependents` (or exited); it must then run
`griddepcontrol.wait` (common.cuh `pdl_wait`) before it reads anything the previous kernel writes or
writes anything it reads. The GEMVs issue their first weight loads before that wait, so the weight
stream of layer op n+1 overlaps the tail of op n. Kernels launched this way are captured into CUDA
graphs as programmatic edges. Every raw kernel runs `pdl_wait` first, so launching any of them
either way is correct; a kernel launched without the attribute sees the wait return at once.

The launch goes through the driver's cuLaunchKernelEx (ctypes on libcuda) with the CUfunction CuPy
compiled (RawKernel.kernel.ptr); arguments are packed from the same values CuPy's launcher takes
(device arrays, numpy scalars).
"""
from __future__ import annotations

import ctypes

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: a 4-byte id padded to 8, then a 64-byte value union whose first 4 bytes are
    the int the PDL attribute takes (programmaticStreamSerializationAllowed)."""
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_ubyte * 4), ("value", ctypes.c_int32),
                ("value_rest", ctypes.c_ubyte * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("shared_mem_bytes", ctypes.c_uint32), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint32)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float,
            np.dtype(np.uint32): ctypes.c_uint32}
_driver = None


def _libcuda():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _driver = lib
    return _driver


def pack_argument(a):
    """One kernel argument as a ctypes value: a device array is its pointer, a numpy scalar its C type."""
    if hasattr(a, "data") and hasattr(a.data, "ptr"):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.generic) and a.dtype in _SCALARS:
        return _SCALARS[a.dtype](a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__}: pass a device array or a numpy "
                    f"int32/int64/uint32/uint64/float32 scalar")


def _dims(d) -> tuple[int, int, int]:
    d = tuple(int(v) for v in (d if isinstance(d, tuple) else (d,)))
    return d + (1,) * (3 - len(d))


def launch(kernel, grid, block, args, stream, pdl: bool = False, shared_mem: int = 0) -> None:
    """Launch a CuPy RawModule function on `stream`; with `pdl`, as a programmatic dependent launch."""
    if not pdl:
        kernel(grid, block, args, stream=stream, shared_mem=shared_mem)
        return
    values = [pack_argument(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = LaunchConfig(grid=(ctypes.c_uint32 * 3)(*_dims(grid)), block=(ctypes.c_uint32 * 3)(*_dims(block)),
                       shared_mem_bytes=shared_mem, stream=stream.ptr, attrs=ctypes.pointer(attr), num_attrs=1)
    function = getattr(kernel, "kernel", kernel)        # RawKernel -> its compiled cupy.cuda.Function
    status = _libcuda().cuLaunchKernelEx(ctypes.byref(cfg), function.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {status} (grid {grid}, block {block})")
