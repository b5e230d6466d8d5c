"""Every raw CUDA kernel file compiles with NVRTC for sm_90 (no GPU needed). NVRTC has no host headers (no
math.h: INFINITY is ours), so this catches what `nvcc -c` does not; where libnvrtc is missing (the CPU
machines) `nvcc -ptx` compiles the same source and defines instead (the front end's errors, not NVRTC's
header limits); skipped where neither is there."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile

import pytest

from openinfer_kernels.raw_cuda import KERNEL_DIR


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


def _compile(path: str, *defines: str) -> None:
    nvrtc, include = _nvrtc(), _cuda_include()
    if nvrtc is None and shutil.which("nvcc"):
        return _compile_with_nvcc(path, *defines)
    if nvrtc is None or include is None:
        pytest.skip("libnvrtc or the CUDA headers are not available")
    with open(path, "rb") as f:
        _, prog = nvrtc.nvrtcCreateProgram(f.read(), os.path.basename(path).encode(), 0, [], [])
    opts = [f"-I{KERNEL_DIR}".encode(), f"-I{include}".encode(), b"--gpu-architecture=sm_90"]
    opts += [f"-D{d}".encode() for d in defines]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    # NVRTC writes into this buffer: a fresh one. `b" " * size` at size 1 (an empty log) is CPython's
    # shared one-byte b" ", and writing the log's NUL into it turned every b" " of the process into
    # b"\x00" (a later test's detokenized spaces came out as NULs).
    log = bytes(max(size, 2))
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.rstrip(b"\0")
    nvrtc.nvrtcDestroyProgram(prog)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")


def _compile_with_nvcc(path: str, *defines: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["nvcc", "-ptx", "-arch=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}", *(f"-D{d}" for d in defines),
               path, "-o", os.path.join(tmp, "out.ptx")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(KERNEL_DIR, "*.cu"))), ids=os.path.basename)
def test_kernel_compiles_with_nvrtc(path):
    _compile(path)


@pytest.mark.parametrize("gqa,head_dim", [(1, 16), (4, 16), (2, 32), (8, 64), (4, 128), (8, 128), (8, 96), (4, 256)])
def test_paged_decode_compiles_for_each_shape(gqa, head_dim):
    """paged_decode.cu is specialized per (GQA, HEAD_DIM) with -D options, as GpuOps compiles it."""
    _compile(os.path.join(KERNEL_DIR, "paged_decode.cu"), f"GQA={gqa}", f"HEAD_DIM={head_dim}")


@pytest.mark.parametrize("gqa,heads", [(8, 4), (8, 2), (8, 1), (4, 2), (4, 1)])
def test_paged_decode_compiles_for_head_groups(gqa, heads):
    """... and per query heads per CTA (HEADS, a divisor of GQA: small grids)."""
    _compile(os.path.join(KERNEL_DIR, "paged_decode.cu"), f"GQA={gqa}", "HEAD_DIM=128", f"HEADS={heads}")


@pytest.mark.parametrize("rank", [8, 16, 64, 128, 256])
def test_splitk_lora_norm_compiles_for_each_rank(rank):
    """rms_norm.cu is compiled per padded LoRA rank (LORA_R) for splitk_rms_norm_residual_lora."""
    _compile(os.path.join(KERNEL_DIR, "rms_norm.cu"), f"LORA_R={rank}")


def test_kernels_include_only_what_nvrtc_finds():
    """Kernel files include each other and <cuda_bf16.h> only: the GPU host's NVRTC headers (pip's
    nvidia/cu13/include) lack the crt/ headers that <mma.h> pulls in, which `nvcc` here would not catch."""
    import re

    local = {os.path.basename(p) for p in glob.glob(os.path.join(KERNEL_DIR, "*.cuh"))}
    for path in glob.glob(os.path.join(KERNEL_DIR, "*.cu*")):
        with open(path, encoding="utf-8") as f:
            for name in re.findall(r'#include\s+[<"]([^>"]+)[>"]', f.read()):
                assert name in local or name == "cuda_bf16.h", f"{os.path.basename(path)} includes {name}"


@pytest.mark.parametrize("fp4,zero,fp16", [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)])
@pytest.mark.parametrize("name", ["gemv_w4.cu", "w4_dequant.cu"])
def test_w4_kernels_compile_for_each_format(name, fp4, zero, fp16):
    """gemv_w4.cu and w4_dequant.cu are compiled per 4-bit format (quant/w4_layout.W4Packed.defines)."""
    _compile(os.path.join(KERNEL_DIR, name), f"W4_FP4={fp4}", f"W4_ZERO={zero}", f"W4_SCALE_FP16={fp16}")


@pytest.mark.parametrize("name,prefix", [("gemv_w4.cu", "W4"), ("gemv_fp8.cu", "FP8")])
@pytest.mark.parametrize("tiles,batch", [(1, 1), (4, 3)])
def test_quantized_gemvs_compile_for_each_shape(name, prefix, tiles, batch):
    """... and per CTA tiles (W4_RT / FP8_RT, dividing the 8 warps) and k steps in flight (W4_U / FP8_U)."""
    _compile(os.path.join(KERNEL_DIR, name), f"{prefix}_RT={tiles}", f"{prefix}_U={batch}")


def test_gemv_fp8_compiles_with_channel_scales():
    _compile(os.path.join(KERNEL_DIR, "gemv_fp8.cu"), "FP8_CHANNEL=1")


@pytest.mark.parametrize("hc_mult", [1, 2, 3, 4, 5])
def test_hyper_connection_kernels_compile_for_each_hc_mult(hc_mult):
    """dsv4_hc.cu is compiled per stream count (HC_N, GpuDSV4Ops._kernel)."""
    _compile(os.path.join(KERNEL_DIR, "dsv4_hc.cu"), f"HC_N={hc_mult}")


@pytest.mark.parametrize("heads,dim", [(4, 16), (2, 32), (64, 128)])
def test_indexer_kernels_compile_for_each_width(heads, dim):
    """dsv4_indexer.cu is compiled per indexer heads and width (IDX_H, IDX_D: the tiny models', V4-Flash's)."""
    _compile(os.path.join(KERNEL_DIR, "dsv4_indexer.cu"), f"IDX_H={heads}", f"IDX_D={dim}")
