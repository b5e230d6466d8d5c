"""GpuShared: what every GPU op family (gpu_ops.py and the gpu_*_ops.py parts) works with, built once by the
executor: the compute stream, the GEMM library, the paged KV pool, the rope table and the activation buffers
every op writes its output into — a ring of RING_SLOTS buffers (a tensor is dead long before its slot comes
round again) and the residual stream's own buffer (updated in place by the residual adds). Nothing here
allocates or waits on the host, so a step's ops can be captured in a CUDA graph; `pdl` is on while a decode
graph is captured (every launch then a programmatic dependent launch, openinfer_kernels/raw_cuda/launch.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from memory.device_arena import Buffer
from memory.kv_format import KVFormat
from openinfer_kernels.raw_cuda.launch import launch

RING_SLOTS = 10


def splitk_norm_threads(hidden: int) -> int:
    """Threads per row of rms_norm.cu's split-K norms (splitk_rms_norm_residual[_lora]): one per 8 columns,
    whole warps."""
    return min(1024, -(-hidden // 256) * 32)


def activation_buffers(plan) -> list[Buffer]:
    """The activation ring and the residual stream of the plan's largest step."""
    rows = plan.max_tokens
    return ([Buffer(f"ring{i}", (rows * plan.width,), np.uint16) for i in range(RING_SLOTS)]
            + [Buffer("residual", (rows * plan.hidden,), np.uint16)])


@dataclass(eq=False)
class GpuShared:
    stream: object                  # the compute stream: every launch goes on it
    gemm: object                    # gpu_gemm.Gemm
    kv_cache: object                # uint16 (bf16) or uint8 (e4m3) [layers, planes, slots, heads, dim]
    inv_freq: object                # float32 [rope_dim / 2]
    attention_factor: float         # cos / sin scaling (yarn)
    num_sms: int
    max_tokens: int                 # rows the activation buffers hold
    ring: list                      # RING_SLOTS buffers of [max_tokens · width] bf16 values
    residual: object                # [max_tokens · hidden] bf16 values
    gate_up_interleaved: bool = False   # gate_up weights in blocks of 8 gate / 8 up rows (gemv.cu's SiLU·up)
    kv_format: KVFormat = KVFormat()    # kv_cache's: bf16, or e4m3 (uint8) with per-layer scales (gpu_kv_format.py)
    pdl: bool = False               # programmatic dependent launches (set while capturing decode)
    capture_pool: object = None     # the CuPy memory pool graph captures allocate from (gpu_graphs.capture_memory)
    ring_next: int = 0

    @classmethod
    def take(cls, arena, plan, **parts) -> "GpuShared":
        """The activation buffers of the plan carved from the arena; parts: the other fields."""
        b = arena.take_all("activations", activation_buffers(plan))
        return cls(ring=[b[f"ring{i}"] for i in range(RING_SLOTS)], residual=b["residual"],
                   num_sms=plan.device.num_sms, max_tokens=plan.max_tokens, **parts)

    @property
    def kv_entry(self) -> str:
        """The suffix of the cache kernels' entries for kv_cache's format ("_fp8" for e4m3)."""
        return "_fp8" if self.kv_format.fp8 else ""

    def kv_scales(self, layer: int) -> tuple:
        """The FP8 entries' trailing (k_scale, v_scale) arguments of a layer; () for bf16."""
        if not self.kv_format.fp8:
            return ()
        return tuple(np.float32(s) for s in self.kv_format.scales[layer])

    def out(self, rows: int, cols: int):
        """The next activation buffer as [rows, cols]."""
        if rows > self.max_tokens:
            raise ValueError(f"{rows} tokens exceed the {self.max_tokens} the activation buffers hold")
        buf = self.ring[self.ring_next]
        self.ring_next = (self.ring_next + 1) % RING_SLOTS
        return buf[: rows * cols].reshape(rows, cols)

    def residual_out(self, rows: int, cols: int):
        """The residual stream's buffer as [rows, cols]."""
        if rows * cols > self.residual.shape[0]:
            raise ValueError(f"{rows} tokens exceed the {self.max_tokens} the residual buffer holds")
        return self.residual[: rows * cols].reshape(rows, cols)

    @contextlib.contextmanager
    def pdl_launches(self, on: bool):
        """Every launch a programmatic dependent launch while inside, when on (a decode graph's capture)."""
        self.pdl = on
        try:
            yield
        finally:
            self.pdl = False

    def launch(self, k, grid, block, args, shared_mem: int = 0) -> None:
        launch(k, grid, block, args, self.stream, pdl=self.pdl, shared_mem=shared_mem)

    def copy(self, dst, src) -> None:
        """dst's bytes from src (device to device), in stream order."""
        import cupy

        rt = cupy.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, rt.memcpyDeviceToDevice, self.stream.ptr)

    def zero(self, a) -> None:
        """a's bytes set to 0, in stream order."""
        import cupy

        cupy.cuda.runtime.memsetAsync(a.data.ptr, 0, a.nbytes, self.stream.ptr)
