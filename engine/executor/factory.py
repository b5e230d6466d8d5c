"""create_executor: the CPU (numpy) executor or the GPU one, picked by device, built from ExecutorOptions."""
from __future__ import annotations

import logging
import os

from engine.executor.base import Executor
from engine.executor.options import ExecutorOptions
from engine.loader import LoadedModel

log = logging.getLogger("openinfer.engine")
DEVICES = ("auto", "cpu", "cuda")


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def nvidia_gpu_present() -> bool:
    """An NVIDIA driver and device node exist (whether or not CuPy can use them)."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/version")


def resolve_device(device: str) -> str:
    """"cpu" or "cuda" for a device choice; "auto" takes the GPU when CuPy sees one."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if gpu_available() else "cpu"
        if device == "cpu" and nvidia_gpu_present():
            log.warning("an NVIDIA GPU is present but CuPy cannot use it: serving on the CPU; for the GPU "
                        "install the CUDA extra (pip install 'openinfer[cuda13]' or 'openinfer[cuda12]')")
    elif device == "cuda" and not gpu_available():
        raise RuntimeError("device='cuda' but no CUDA GPU is usable (is cupy installed? "
                           "pip install 'openinfer[cuda12]' or 'openinfer[cuda13]')")
    return device


def create_executor(model: LoadedModel, options: ExecutorOptions, device: str = "auto") -> Executor:
    """The executor for `device` ("cpu", "cuda" or "auto"), carrying `options` (tensor_parallel_size > 1:
    rank 0's executor over the model's shards, engine/parallel)."""
    device = resolve_device(device)
    if device == "cuda" and not model.model.gpu_supported:
        raise ValueError(f"{model.config.model_type}: the GPU executor does not run this model line yet "
                         f"(serve it with --device cpu)")
    if options.tensor_parallel_size > 1:
        from engine.parallel.launch import create_parallel_executor
        return create_parallel_executor(model, options, device)
    log.info("executor: %s (%s)", "GPU" if device == "cuda" else "CPU (numpy)", model.config.model_type)
    if device == "cuda":
        from engine.executor.gpu import GpuExecutor
        return GpuExecutor(model, options)
    from engine.executor.cpu import CpuExecutor
    return CpuExecutor(model, options)
