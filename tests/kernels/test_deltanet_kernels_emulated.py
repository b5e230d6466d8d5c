"""The Gated DeltaNet raw CUDA kernels (causal_conv1d.cu, gated_delta_rule.cu, gated_rms_norm.cu,
sigmoid_gate.cu) run through their GPU ops (engine/executor/gpu_deltanet_ops.py: the same grids,
arguments and strides) on the host, without a GPU: g++ compiles each kernel with
tests/cuda_emulation.h (one OS thread per CUDA thread, barriers for __syncthreads), and the results
are checked against numpy (tests/deltanet_kernel_cases.py). Skipped without g++ or the CUDA headers.
What it cannot see (speed, coalescing, occupancy, shared-memory limits) is for test_gpu_deltanet.py."""
from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest

from deltanet_kernel_cases import (SHAPES, STEPS, check_conv_and_delta_rule, check_gated_rms_norm_and_sigmoid_gate,
                                   random_inputs, run_conv_and_delta_rule, spec_of)
from engine.executor.gpu_deltanet_ops import GpuDeltaNetOps
from openinfer_kernels.raw_cuda import KERNEL_DIR
from openinfer_kernels.raw_cuda.launch import pack_argument

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DYNAMIC_SMEM = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?(\w+(?: \w+)?) (\w+)\[\];")   # -> the block's buffer
ENTRY = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(([^)]*)\)')


def _cuda_include() -> str | None:
    for d in (os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"):
        if d and os.path.isfile(os.path.join(d, "include", "cuda_bf16.h")):
            return os.path.join(d, "include")
    return None


def _param_types(params: str) -> list[str]:
    """C types of a kernel's parameters ("const bf16_t* __restrict__ x" -> "const bf16_t*")."""
    out = []
    for p in params.split(","):
        words = p.replace("__restrict__", "").replace("*", " * ").split()
        out.append(" ".join(words[:-1]).replace(" *", "*"))
    return out


@functools.lru_cache(maxsize=None)
def emulated(name: str, defines: tuple[tuple[str, int], ...] = ()) -> ctypes.CDLL:
    """openinfer_kernels/raw_cuda/<name>.cu built for the host; entry E is emu_E(gx, gy, gz, threads, smem, args)."""
    include, gxx = _cuda_include(), shutil.which("g++")
    if include is None or gxx is None:
        pytest.skip("g++ or the CUDA headers (cuda_bf16.h) are not available")
    with open(os.path.join(KERNEL_DIR, f"{name}.cu"), encoding="utf-8") as f:
        source = DYNAMIC_SMEM.sub(lambda m: f"{m[1]}* {m[2]} = reinterpret_cast<{m[1]}*>(emu_dynamic_smem.data());",
                                  f.read())
    wrappers = []
    for entry, params in ENTRY.findall(source):
        args = ", ".join(f"*({t}*)a[{i}]" for i, t in enumerate(_param_types(params)))
        wrappers.append(f'extern "C" void emu_{entry}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, '
                        f'size_t smem, void** a) {{ emu_launch({{gx, gy, gz}}, threads, smem, '
                        f'[&] {{ {entry}({args}); }}); }}')
    out = tempfile.mkdtemp(prefix="openinfer-emu-")
    cpp, lib = os.path.join(out, f"{name}.cpp"), os.path.join(out, f"{name}.so")
    with open(cpp, "w", encoding="utf-8") as f:
        f.write('#include "cuda_emulation.h"\nusing std::min;\nusing std::max;\n' + source + "\n" + "\n".join(wrappers))
    # -fno-gnu-unique: a template's __shared__ (a static) stays the library's own; as a unique symbol the first
    # build loaded (another HEAD_DIM, another size) would serve every later one
    cmd = [gxx, "-std=c++20", "-O1", "-fno-gnu-unique", "-shared", "-fPIC", "-pthread", f"-I{TESTS}",
           f"-I{KERNEL_DIR}", f"-I{include}", *[f"-D{k}={v}" for k, v in defines], cpp, "-o", lib]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(lib)


class HostArray(np.ndarray):
    """A numpy array that passes for a device array (`.data.ptr`) in the ops' kernel arguments."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


def host(a) -> HostArray:
    return np.ascontiguousarray(a).view(HostArray)


class EmulatedShared:
    """What the GPU op families share (gpu_shared.GpuShared), with launches run by the host emulation (kernels
    as (file, entry, defines)) and outputs in host memory."""
    pdl, gate_up_interleaved = False, False
    num_sms = 132                   # an H100's / H200's (grid choices)

    def launch(self, k, grid, block, args, shared_mem=0):
        name, entry, defines = k
        values = [pack_argument(a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        g = tuple(grid) + (1,) * (3 - len(grid))
        getattr(emulated(name, defines), f"emu_{entry}")(*(ctypes.c_uint(v) for v in g), ctypes.c_uint(block[0]),
                                                          ctypes.c_size_t(shared_mem), params)

    def out(self, rows, cols):
        return host(np.zeros((rows, cols), np.uint16))


class EmulatedOps(GpuDeltaNetOps):
    """The GPU ops with their launches run by the host emulation and their outputs in host memory."""

    def __init__(self):
        super().__init__(EmulatedShared(), None)

    def _kernel(self, name, entry, **defines):
        return name, entry, tuple(sorted(defines.items()))


def back(a) -> np.ndarray:
    return np.asarray(a)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("step_name", sorted(STEPS))
def test_conv_and_delta_rule_match_numpy(shape, step_name):
    spec, step = spec_of(*shape), STEPS[step_name]
    inp = random_inputs(spec, step, num_slots=4, seed=len(step.lens))
    got = run_conv_and_delta_rule(EmulatedOps(), spec, step, inp, host, back)
    check_conv_and_delta_rule(spec, step, inp, got)


def test_gated_rms_norm_and_sigmoid_gate_match_numpy():
    check_gated_rms_norm_and_sigmoid_gate(EmulatedOps(), spec_of(*SHAPES[1]), 96, host, back)


def test_a_dropped_state_is_caught():
    """The check can fail: with the recurrent state zeroed before the step, the delta rule no longer matches."""
    spec, step = spec_of(*SHAPES[0]), STEPS["mixed"]
    inp = random_inputs(spec, step, num_slots=4, seed=3)
    got = run_conv_and_delta_rule(EmulatedOps(), spec, step, {**inp, "rec_state": 0 * inp["rec_state"]}, host, back)
    with pytest.raises(AssertionError):
        check_conv_and_delta_rule(spec, step, inp, got)


@pytest.mark.parametrize("name,defines", [("causal_conv1d", ["CONV_K=3"]), ("gated_delta_rule", []),
                                          ("gated_delta_rule", ["DK=256"]), ("gated_rms_norm", []),
                                          ("sigmoid_gate", [])])
def test_kernel_compiles_with_nvcc_for_sm90a(name, defines, tmp_path):
    """The device build the GPU runs (NVRTC there; nvcc here, where NVRTC's Python binding is missing)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not available")
    subprocess.run([nvcc, "-arch=sm_90a", "-c", os.path.join(KERNEL_DIR, f"{name}.cu"), "-o", str(tmp_path / "k.o"),
                    *[f"-D{d}" for d in defines]], check=True, capture_output=True, text=True)
