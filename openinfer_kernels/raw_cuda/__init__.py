"""Raw CUDA kernels: one `.cu` file per kernel family, compiled at first use by CuPy's RawModule
(NVRTC, for the device's own architecture, sm_90 on Hopper) and cached on disk by CuPy."""
from __future__ import annotations

import functools
import os

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def module(name: str, defines: tuple[tuple[str, int], ...] = ()):
    """The compiled RawModule of `<name>.cu`, with `-DNAME=value` for each of `defines`."""
    import cupy

    path = os.path.join(KERNEL_DIR, f"{name}.cu")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no raw CUDA kernel source {path}")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    options = [f"-I{KERNEL_DIR}"] + [f"-D{k}={int(v)}" for k, v in defines]
    cuda_path = getattr(cupy.cuda, "get_cuda_path", lambda: None)()
    if cuda_path and os.path.isdir(os.path.join(cuda_path, "include")):
        options.append(f"-I{os.path.join(cuda_path, 'include')}")
    return cupy.RawModule(code=source, options=tuple(options))


def kernel(name: str, function: str, **defines: int):
    """One `extern "C"` function of `<name>.cu`, compiled with the given compile-time constants."""
    return module(name, tuple(sorted(defines.items()))).get_function(function)
