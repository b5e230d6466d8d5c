"""Raw CUDA kernels: one `.cu` file per kernel family, compiled at first use by CuPy's RawModule
(NVRTC, for the device's own architecture, sm_90 on Hopper) and cached on disk by CuPy."""
from __future__ import annotations

import functools
import os

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def headers_digest(kernel_dir: str = KERNEL_DIR) -> str:
    """A digest of every shared header (*.cuh) of the kernels. CuPy's on-disk kernel cache keys a module by
    its source text and options, not by the headers it includes, so the source carries this digest: an
    engine upgraded under a kept cache (CUPY_CACHE_DIR on a volume) never runs a kernel built against an
    older header."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(kernel_dir) if f.endswith(".cuh")):
        with open(os.path.join(kernel_dir, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def module_source(name: str, kernel_dir: str = KERNEL_DIR) -> str:
    """`<name>.cu`'s source as compiled: the headers' digest in its first line."""
    path = os.path.join(kernel_dir, f"{name}.cu")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no raw CUDA kernel source {path}")
    with open(path, encoding="utf-8") as f:
        return f"// openinfer kernel headers {headers_digest(kernel_dir)}\n" + f.read()


@functools.lru_cache(maxsize=None)
def module(name: str, defines: tuple[tuple[str, int], ...] = ()):
    """The compiled RawModule of `<name>.cu`, with `-DNAME=value` for each of `defines`."""
    import cupy

    source = module_source(name)
    options = [f"-I{KERNEL_DIR}"] + [f"-D{k}={int(v)}" for k, v in defines]
    cuda_path = getattr(cupy.cuda, "get_cuda_path", lambda: None)()
    if cuda_path and os.path.isdir(os.path.join(cuda_path, "include")):
        options.append(f"-I{os.path.join(cuda_path, 'include')}")
    return cupy.RawModule(code=source, options=tuple(options))


def kernel(name: str, function: str, **defines: int):
    """One `extern "C"` function of `<name>.cu`, compiled with the given compile-time constants."""
    return module(name, tuple(sorted(defines.items()))).get_function(function)
