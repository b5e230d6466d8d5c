"""create_executor: the CPU (numpy) executor or the GPU one, picked by device."""
from __future__ import annotations

import logging

from engine.executor.base import Executor
from engine.loader import LoadedModel

log = logging.getLogger(__name__)


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def create_executor(model: LoadedModel, device: str = "auto", num_kv_blocks: int | None = None,
                    gpu_memory_utilization: float = 0.9, max_model_len: int | None = None) -> Executor:
    """device: "cpu", "cuda", or "auto" (cuda when a GPU and CuPy are present, else cpu)."""
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "auto":
        device = "cuda" if gpu_available() else "cpu"
        log.info("executor device: %s", device)
    if device == "cuda":
        if not gpu_available():
            raise RuntimeError("device='cuda' but no CUDA GPU is usable (is cupy installed? "
                               "pip install 'openinfer[cuda12]' or 'openinfer[cuda13]')")
        from engine.executor.gpu import GpuExecutor
        return GpuExecutor(model, num_kv_blocks=num_kv_blocks,
                           gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len)
    from engine.executor.cpu import CpuExecutor
    return CpuExecutor(model, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len)
