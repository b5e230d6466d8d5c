"""The executors' environment variables, read here and nowhere else, once: the GPU executor's into
GpuTuning, and the BLAS thread count of the CPU executor's larger steps (cpu_threads_from_env).

| variable | GpuTuning field | default |
| --- | --- | --- |
| OPENINFER_DECODE_KERNELS | decode_kernels | all |
| OPENINFER_GEMM | gemm | auto |
| OPENINFER_PREFILL_ATTENTION | prefill_attention | cute |
| OPENINFER_PDL | pdl ("0": off) | 1 |
| OPENINFER_GEMV_UNROLL | gemv_unroll | 2 |
| OPENINFER_GEMV_UNROLL_NARROW | gemv_unroll_narrow | 4 |
| OPENINFER_LAYER_RANGES | nvtx ("1": layers, "ops": ops) | 0 |
| OPENINFER_EAGER_GRAPH_TOKENS | eager_graph_tokens (0: off) | 2048 |
| OPENINFER_CHUNK_ATTENTION | chunk_attention ("0": off) | 1 |
| OPENINFER_ASYNC_HOST_TIER | async_host_tier ("1": on) | 0 |
| OPENINFER_LORA_GATE_UP_IN_K | lora_gate_up_in_k ("1": on) | 0 |
| OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS | ExecutorOptions.cpu_threads (without --cpu-threads) | cores less one |
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from engine.executor.options import GpuTuning

NVTX_VALUES = {"0": "off", "": "off", "off": "off", "1": "layers", "layers": "layers", "ops": "ops"}


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r}: want an integer") from None


def gpu_tuning_from_env(env: Mapping[str, str] | None = None) -> GpuTuning:
    """GpuTuning from the environment (unset variables keep GpuTuning's defaults); raises ValueError
    naming the variable on a value that does not parse."""
    env = os.environ if env is None else env
    d = GpuTuning()
    nvtx = env.get("OPENINFER_LAYER_RANGES", "0").strip().lower()
    if nvtx not in NVTX_VALUES:
        raise ValueError(f"$OPENINFER_LAYER_RANGES={nvtx!r}: want 0, 1 or ops")
    tuning = GpuTuning(
        decode_kernels=env.get("OPENINFER_DECODE_KERNELS") or d.decode_kernels,
        gemm=env.get("OPENINFER_GEMM") or d.gemm,
        prefill_attention=env.get("OPENINFER_PREFILL_ATTENTION") or d.prefill_attention,
        pdl=env.get("OPENINFER_PDL", "1").strip() != "0",
        gemv_unroll=_int(env, "OPENINFER_GEMV_UNROLL", d.gemv_unroll),
        gemv_unroll_narrow=_int(env, "OPENINFER_GEMV_UNROLL_NARROW", d.gemv_unroll_narrow),
        eager_graph_tokens=_int(env, "OPENINFER_EAGER_GRAPH_TOKENS", d.eager_graph_tokens),
        chunk_attention=env.get("OPENINFER_CHUNK_ATTENTION", "1").strip() != "0",
        async_host_tier=env.get("OPENINFER_ASYNC_HOST_TIER", "0").strip() == "1",
        lora_gate_up_in_k=env.get("OPENINFER_LORA_GATE_UP_IN_K", "0").strip() == "1",
        nvtx=NVTX_VALUES[nvtx])
    tuning.validate()
    return tuning


def cpu_threads_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The BLAS threads a user asked for with OPENBLAS_NUM_THREADS (else OMP_NUM_THREADS), or None;
    ValueError naming the variable for one that is not a positive integer."""
    env = os.environ if env is None else env
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if env.get(name, "").strip():
            threads = _int(env, name, 0)
            if threads < 1:
                raise ValueError(f"${name}={env[name]!r}: want a positive integer")
            return threads
    return None
