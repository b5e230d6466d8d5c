"""What `openinfer serve` says at start: which executor serves on which device and why, which kernel
library runs the linear layers, and — where an NVIDIA GPU is present but CuPy is not — how to get GPU
serving."""
from __future__ import annotations

import os
import shutil

CUDA_INSTALL_HINT = ("pip install -e '.[cuda,cute]' && python -m openinfer_kernels.cute.build (the README's GPU "
                     "command; cuda is for a CUDA 13 driver, cuda12 for a CUDA 12 one)")


def nvidia_gpu_present() -> str | None:
    """How this machine shows an NVIDIA GPU (/dev/nvidia0, nvidia-smi), or None."""
    if os.path.exists("/dev/nvidia0"):
        return "/dev/nvidia0"
    return "nvidia-smi" if shutil.which("nvidia-smi") else None


def cupy_status() -> str | None:
    """Why CuPy cannot serve (not installed, no device, driver error), or None when it sees a GPU."""
    try:
        import cupy
    except Exception as exc:
        return f"CuPy is not installed ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"CuPy sees no GPU ({type(exc).__name__}: {exc})"
    return None if count > 0 else "CuPy sees no GPU"


def gpu_warning(device: str) -> str | None:
    """The start-up warning for a GPU that will not be used because CuPy cannot drive it."""
    if device == "cpu":
        return None
    shown_by, problem = nvidia_gpu_present(), cupy_status()
    if shown_by is None or problem is None:
        return None
    return (f"an NVIDIA GPU is present ({shown_by}) but {problem}: serving on the CPU (numpy executor, "
            f"slow). For GPU serving: {CUDA_INSTALL_HINT}")


def startup_notes(handle, device: str) -> list[tuple[int, str]]:
    """(log level, line) pairs said at start: the GPU warning, then the executor line. With an engine
    process they are made there (`EngineClient(notes=startup_notes)`): asking CuPy for the device count
    in the server process before it forks would initialise CUDA there, and a forked child cannot use it."""
    import logging

    warning = gpu_warning(device)
    return ([(logging.WARNING, warning)] if warning else []) + [(logging.INFO, describe_executor(handle, device))]


def describe_executor(handle, device: str) -> str:
    """One line: executor, device, why that device, and the kernel library of the linear layers (rank 0's,
    with the number of ranks, under tensor parallelism). An EngineClient has no executor here (it is in the
    engine process): its device follows the rule the executor factory applies, and on the GPU the engine
    process logs the library itself (and the tensor-parallel ranks)."""
    executor = handle.executor                                # None: it runs in the engine process
    where = "" if executor is not None else "; it runs in the engine process"
    if executor is not None and executor.world_size > 1:
        where += f"; tensor parallel over {executor.world_size} ranks"
    executor = executor.rank0() if executor is not None else None     # tensor parallel: rank 0's executor
    if executor is not None and executor.gemm is not None:
        library = executor.gemm.describe()
        return f"executor: {type(executor).__name__} on the GPU (--device {device}){where}; {library}"
    if executor is None and (device == "cuda" or (device == "auto" and cupy_status() is None)):
        return f"executor: GpuExecutor on the GPU (--device {device}){where}, which logs its linear layers' library"
    name = type(executor).__name__ if executor is not None else "CpuExecutor"
    why = "--device cpu" if device == "cpu" else f"--device {device} and {cupy_status() or 'no GPU'}"
    threads = executor.threads if executor is not None else None
    threads = f"; {threads.describe()}" if threads is not None else ""
    return f"executor: {name} (numpy) on the CPU ({why}){where}; linear layers: numpy matmul ({_blas()}){threads}"


def _blas() -> str:
    try:
        import numpy
        config = numpy.show_config(mode="dicts")
        return "BLAS: " + config["Build Dependencies"]["blas"]["name"]
    except Exception:
        return "BLAS unknown"
