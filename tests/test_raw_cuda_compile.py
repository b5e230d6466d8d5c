"""Every raw CUDA kernel file compiles with NVRTC for sm_90 (no GPU needed; skipped without libnvrtc).
NVRTC has no host headers (no math.h: INFINITY is ours), so this catches what `nvcc -c` does not."""
from __future__ import annotations

import glob
import os

import pytest

from kernels.raw_cuda import KERNEL_DIR


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()
        return nvrtc
    except Exception:
        return None


def _cuda_include() -> str | None:
    for d in (os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"):
        if d and os.path.isfile(os.path.join(d, "include", "cuda_bf16.h")):
            return os.path.join(d, "include")
    return None


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(KERNEL_DIR, "*.cu"))), ids=os.path.basename)
def test_kernel_compiles_with_nvrtc(path):
    nvrtc, include = _nvrtc(), _cuda_include()
    if nvrtc is None or include is None:
        pytest.skip("libnvrtc or the CUDA headers are not available")
    with open(path, "rb") as f:
        _, prog = nvrtc.nvrtcCreateProgram(f.read(), os.path.basename(path).encode(), 0, [], [])
    opts = [f"-I{KERNEL_DIR}".encode(), f"-I{include}".encode(), b"--gpu-architecture=sm_90"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
