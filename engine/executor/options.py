"""ExecutorOptions: every setting an executor runs with, built once from EngineConfig (and, for the
GPU kernel choices, the environment: engine/env.py) and checked before anything loads.

The scheduler plans within the same StepLimits (engine/limits.py), so a step the executor cannot
take is never planned: at most `max_num_batched_tokens` tokens and `max_num_seqs` sequences, no
position at or past `max_model_len`. A combination that cannot work is refused here, at start, with the flag's name.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine import env as environment
from engine.limits import StepLimits, resolve_limits
from memory.kv_format import is_fp8

LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(StepLimits))

# Decode batch sizes captured as CUDA graphs (vLLM's --cuda-graph-sizes); a batch pads up to the next.
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
DTYPES = ("auto", "bfloat16", "float16", "float32")
GPU_DTYPES = ("auto", "bfloat16")            # the GPU kernels are bf16 (fp32 accumulation)


# Decode GEMV row limits of "all" / a bare "gemv". Batches above 8 take the GEMM: the GEMV's two n8
# tiles made Qwen3-4B batch 12 / 16 steps 4.97 / 5.04 ms against 4.00 / 3.99 with cuBLAS (H200,
# 2026-12-01 04:50 UTC, bench/results/decode.md).
DEFAULT_GEMV_MAX_M = 8
# With the CuTe GEMM the GEMV keeps batch 1 only: Qwen3-8B batch 1 4.81 ms against 4.98 on CuTe, but
# batch 2 / 4 / 8 4.90 / 5.07 / 5.41 against 4.88 / 4.98 / 5.06 (Qwen3-4B: 3.24-3.34 on CuTe at
# batches 1-8 against 3.34-3.83; H200, 2026-12-01 21:17 UTC).
DEFAULT_GEMV_MAX_M_CUTE = 1


def parse_decode_kernels(spec: str, default_rows: int = DEFAULT_GEMV_MAX_M) -> tuple[bool, int]:
    """"attention,gemv:16" -> (fast attention on, GEMV for at most 16 rows); "" -> (False, 0);
    "all" and a bare "gemv" give the GEMV ``default_rows``."""
    fast, gemv_m = False, 0
    for item in (x.strip().lower() for x in spec.split(",")):
        if item in ("", "none", "0", "off"):
            continue
        if item in ("all", "1", "on"):
            fast, gemv_m = True, default_rows
        elif item == "attention":
            fast = True
        elif item == "gemv" or item.startswith("gemv:"):
            try:
                gemv_m = int(item[5:]) if ":" in item else default_rows
            except ValueError:
                raise ValueError(f"decode kernels: bad row limit in {item!r} (want gemv:N)") from None
        else:
            raise ValueError(f"decode kernels: unknown item {item!r} (want attention, gemv[:N], all)")
    return fast, gemv_m


@dataclass(frozen=True)
class GpuTuning:
    """The GPU executor's kernel choices (docs/gpu.md "Decode" lists them with their variables).

    decode_kernels: "all" | "none" | a comma list of "attention", "gemv[:rows]".
    gemm: "auto" (CuTe GEMM for products of at most 128 rows where built, cuBLAS above) | "cute" | "cublas".
    prefill_attention: "cute" | "cute:N" (sequences of at least N new tokens) | "paged".
    pdl: programmatic dependent launches in the decode graphs.
    gemv_unroll / gemv_unroll_narrow: gemv.cu k steps per weight batch (wide / narrow products).
    nvtx: "off" | "layers" (a range per decoder layer in eager steps) | "ops" (and per op).
    eager_graph_tokens: eager (prefill / mixed) steps of up to this many tokens run as piecewise CUDA graphs
    by token bucket, attention launched between them (gpu_piecewise.py; 0: off; dense lines only).
    chunk_attention: runs of 2+ new tokens below the CuTe minimum on paged_chunk.cu's tensor cores
    (gpu_chunk.py; with the CuTe prefill path) instead of paged_decode.cu.
    async_host_tier: host-tier restores and write-through copies on a stream of their own, their sequences
    LOADING and their blocks held until the copies land (engine/scheduler.py), instead of the copies ahead
    of the next step on the compute stream (OPENINFER_ASYNC_HOST_TIER=0)."""
    decode_kernels: str = "all"
    gemm: str = "auto"
    prefill_attention: str = "cute"
    pdl: bool = True
    gemv_unroll: int = 2
    gemv_unroll_narrow: int = 4
    nvtx: str = "off"
    eager_graph_tokens: int = 2048
    chunk_attention: bool = True
    async_host_tier: bool = True

    def validate(self) -> None:
        """Parse every choice once (the parsers raise ValueError naming the setting)."""
        from engine.executor.gpu_gemm import cute_rows
        from engine.executor.gpu_prefill import parse_prefill_attention

        parse_decode_kernels(self.decode_kernels)
        cute_rows(self.gemm)
        parse_prefill_attention(self.prefill_attention)
        for name, value in (("gemv_unroll", self.gemv_unroll), ("gemv_unroll_narrow", self.gemv_unroll_narrow)):
            if not 1 <= value <= 16:
                raise ValueError(f"{name} must be in 1..16, got {value}")
        if self.eager_graph_tokens < 0:
            raise ValueError(f"eager_graph_tokens must be >= 0, got {self.eager_graph_tokens}")
        if self.nvtx not in ("off", "layers", "ops"):
            raise ValueError(f"nvtx must be off, layers or ops, got {self.nvtx!r}")


def gpu_tuning_from_env(env: Mapping[str, str] | None = None) -> GpuTuning:
    """GpuTuning from the environment's variables (engine/env.py; unset ones keep the defaults); raises
    ValueError naming the variable on a value that does not parse."""
    e = environment
    tuning = GpuTuning(
        decode_kernels=e.DECODE_KERNELS.read(env), gemm=e.GEMM.read(env),
        prefill_attention=e.PREFILL_ATTENTION.read(env), pdl=e.PDL.read(env),
        gemv_unroll=e.GEMV_UNROLL.read(env), gemv_unroll_narrow=e.GEMV_UNROLL_NARROW.read(env),
        nvtx=e.LAYER_RANGES.read(env), eager_graph_tokens=e.EAGER_GRAPH_TOKENS.read(env),
        chunk_attention=e.CHUNK_ATTENTION.read(env), async_host_tier=e.ASYNC_HOST_TIER.read(env))
    tuning.validate()
    return tuning


@dataclass(frozen=True)
class ExecutorOptions:
    """limits: the step limits the executor is built for (engine/limits.py; max_model_len,
    max_num_seqs and max_num_batched_tokens read through). num_kv_blocks: the KV pool in blocks
    (None: what the memory budget holds: gpu_memory_utilization on the GPU, 1 GiB on the CPU). dtype:
    "auto" / "float32" keep the checkpoint's values (the CPU computes in float32), "bfloat16" / "float16" round the weights to
    it (the CPU then matches the GPU's weights); the GPU runs bfloat16 only. cuda_graphs: replay
    decode steps as CUDA graphs of the batch sizes in cuda_graph_sizes (up to max_num_seqs).
    host_kv_blocks: host KV tier slots the executor allocates. progress: the weight-upload bar.
    time_steps: CUDA events around every step (EngineConfig.step_trace turns it on). max_loras: LoRA
    adapter slots (0: LoRA off), of max_lora_rank ranks each. tensor_parallel_size: ranks the model is
    split across (engine/parallel; every rank runs with these options). cpu_threads: the CPU executor's
    BLAS threads for steps above decode size (engine/executor/cpu_threads.py; None: the cores less one).
    num_speculative_tokens: the draft tokens a verify step may carry per sequence (speculative decoding's k; 0:
    off): the GPU sizes its sampled rows for 1 + k per sequence.
    kv_cache_dtype: --kv-cache-dtype (memory/kv_format.py: "fp8" / "fp8_e4m3" store the pool as e4m3)."""
    limits: StepLimits = field(default_factory=lambda: StepLimits(4096, 64, 2048))
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    cuda_graphs: bool = True
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES
    host_kv_blocks: int = 0
    progress: bool = True
    time_steps: bool = False                 # time each step on the device (the step trace's GPU column)
    gpu: GpuTuning = field(default_factory=GpuTuning)
    max_loras: int = 0
    max_lora_rank: int = 16
    tensor_parallel_size: int = 1
    cpu_threads: int | None = None
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"
    max_model_len = property(lambda self: self.limits.max_model_len)                    # read through the limits
    max_num_seqs = property(lambda self: self.limits.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.limits.max_num_batched_tokens)

    def validate(self) -> None:
        checks = [
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (all(isinstance(b, int) and b >= 1 for b in self.cuda_graph_sizes) and len(self.cuda_graph_sizes) > 0,
             f"cuda_graph_sizes must be positive integers, got {self.cuda_graph_sizes}"),
            (self.host_kv_blocks >= 0, "host_kv_blocks must be >= 0"),
            (self.max_loras >= 0 and self.max_lora_rank >= 1, "max_loras must be >= 0, max_lora_rank >= 1"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.cpu_threads is None or self.cpu_threads >= 1, f"cpu_threads must be >= 1, got {self.cpu_threads}"),
            (self.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        is_fp8(self.kv_cache_dtype)
        self.gpu.validate()

    def validate_for_gpu(self) -> None:
        if self.dtype not in GPU_DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: the GPU executor runs bfloat16 (use --dtype auto or "
                             f"bfloat16, or --device cpu for {self.dtype})")

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """The captured decode batch sizes: the configured ones up to max_num_seqs, and max_num_seqs."""
        sizes = sorted({b for b in self.cuda_graph_sizes if b < self.max_num_seqs} | {self.max_num_seqs})
        return tuple(sizes)

    def replace(self, **changes) -> "ExecutorOptions":
        """A copy with `changes`, StepLimits' fields among them by name."""
        limits = {name: changes.pop(name) for name in LIMIT_FIELDS if name in changes}
        if limits:
            changes["limits"] = dataclasses.replace(changes.get("limits", self.limits), **limits)
        return dataclasses.replace(self, **changes)


def executor_options(config, device: str, limits: StepLimits) -> ExecutorOptions:
    """The executor's options for an EngineConfig on a resolved device ("cpu" / "cuda"), built for its
    resolved limits (engine/limits.py); the GPU kernel choices are config.gpu, else the environment's.
    Raises ValueError naming the flag for a combination that cannot work."""
    options = ExecutorOptions(
        limits=limits, num_kv_blocks=config.num_kv_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
        dtype=config.dtype, cuda_graphs=not config.enforce_eager,
        cuda_graph_sizes=tuple(config.cuda_graph_sizes), host_kv_blocks=config.host_kv_blocks,
        progress=config.progress, time_steps=config.step_trace is not None,
        gpu=config.gpu or gpu_tuning_from_env(), max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank, tensor_parallel_size=config.tensor_parallel_size,
        cpu_threads=(config.cpu_threads or environment.cpu_threads_from_env()) if device == "cpu" else None,
        num_speculative_tokens=spec.num_speculative_tokens if (spec := config.speculative_config) else 0,
        kv_cache_dtype=config.kv_cache_dtype)
    options.validate()
    if device == "cuda":
        options.validate_for_gpu()
    return options


def resolved_options(config, device: str, model_max_len: int) -> tuple[StepLimits, ExecutorOptions]:
    """An EngineConfig's limits, resolved once for the device and the model's own context
    (max_position_embeddings), and the executor's options built for them."""
    limits = resolve_limits(config, device, model_max_len)
    return limits, executor_options(config, device, limits)


def options_of(**settings) -> ExecutorOptions:
    """ExecutorOptions from flat settings: its own fields, StepLimits' and GpuTuning's by name, the GPU
    choices not given taken from the environment (tests and benchmarks build executors directly this way)."""
    tuning_fields = {f.name for f in dataclasses.fields(GpuTuning)}
    tuning = {k: settings.pop(k) for k in list(settings) if k in tuning_fields}
    gpu = dataclasses.replace(settings.pop("gpu", None) or gpu_tuning_from_env(), **tuning)
    return ExecutorOptions(gpu=gpu).replace(**settings)
