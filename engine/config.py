"""EngineConfig: everything that shapes one engine instance (model, device, batch and KV limits).

Its limits are resolved once into StepLimits (engine/limits.py), which the executor is built for and
the scheduler plans within; the rest travels EngineConfig -> ExecutorOptions (engine/executor/options.py,
with the GPU kernel choices of GpuTuning) -> the executor.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.executor.options import DEFAULT_GRAPH_SIZES, DTYPES, GpuTuning
from engine.kv_events import KVEventsConfig
from engine.lora import MAX_LORA_RANK
from engine.speculative import SpeculativeConfig
from memory.kv_format import is_fp8

@dataclass
class EngineConfig:
    """Names follow vLLM's engine arguments where vLLM has one.

    model: an HF model folder or a .gguf file; None serves the built-in demo model.
    max_model_len: prompt + output token limit per sequence; None takes the model's own limit.
    max_num_seqs / max_num_batched_tokens: sequences / tokens per step; None takes the device's
    default (engine/limits.py DEFAULT_LIMITS: vLLM's 256 / 8192 on the GPU). With the CPU executor a modelled time
    bounds the step too (its StepCost: engine/step_budget.py).
    num_kv_blocks: size of the paged KV pool in 16-token blocks; None lets the executor size
    it (from gpu_memory_utilization on the GPU).
    enable_chunked_prefill: split prompts longer than a step's token budget over several steps
    (off: max_num_batched_tokens must hold max_model_len).
    enforce_eager / cuda_graph_sizes: no CUDA graphs / the decode batch sizes captured.
    gpu: the GPU kernel choices (None: from the environment, engine/env.py).
    enable_lora / lora_modules / max_loras / max_lora_rank / max_cpu_loras: LoRA adapters
    (engine/lora.py): the (name, path) pairs loaded at start, the adapters resident in the executor at
    once (the rest wait in host memory), the largest rank taken, and the adapters kept in host memory
    (None: every loaded one; the others are read from their folders again when a request needs them).
    tensor_parallel_size: ranks one model is split across (one process per GPU; threads on the CPU;
    engine/parallel).
    kv_events_config: vLLM's --kv-events-config: the prefix cache's changes published for a KV-aware router
    (engine/kv_events.py).
    cpu_threads: the CPU executor's BLAS threads for steps above decode size (None: $OPENBLAS_NUM_THREADS,
    else the cores less one; decode-size steps run on one: engine/executor/cpu_threads.py).
    data_parallel_size / data_parallel_rank: whole engines serving one endpoint (engine/process_replicas.py) and
    this one's place among them: its KV events carry the rank, on the endpoint's port + rank.
    quantization: vLLM's --quantization ("fp8": the line's linear layers quantized at load, W8A8;
    engine/loader/kept_linear.py).
    speculative_config: vLLM's --speculative-config: draft tokens verified in each decode step
    (engine/speculative.py; None: off).
    kv_cache_dtype: vLLM's --kv-cache-dtype: "auto" / "bfloat16" keep the executor's KV dtype, "fp8" / "fp8_e4m3"
    store e4m3 with the checkpoint's per-tensor scales (else 1.0; memory/kv_format.py).
    """
    model: str | None = None
    device: str = "auto"                     # "auto" | "cpu" | "cuda"
    dtype: str = "auto"                      # "auto" | "bfloat16" | "float16" | "float32"
    quantization: str | None = None          # None | "fp8"
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES
    max_n: int = 16                          # largest n (samples per request) accepted
    seed: int = 0                            # seeds the RNG of requests that bring no seed
    overlap_steps: bool = True               # detokenize / send step N's tokens while step N+1 runs
    schedule_ahead: bool = True              # with overlap_steps: plan decode step N+1 while step N runs
    async_scheduling: bool = True            # with schedule_ahead: queue decode step N+1 before N's ids are back
    host_kv_blocks: int = 0                  # host KV tier: evicted prefix-cache blocks kept in host memory
    kv_offload_gib: float = 0.0              # the host tier sized in GiB instead (the model's block bytes)
    gpu: GpuTuning | None = None
    progress: bool = True                    # the weight-upload progress bar
    step_trace: str | None = None            # a JSONL file: one line per engine step (engine/step_trace.py)
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    tensor_parallel_size: int = 1
    kv_events_config: KVEventsConfig | None = None
    cpu_threads: int | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    speculative_config: SpeculativeConfig | None = None
    kv_cache_dtype: str = "auto"             # vLLM's --kv-cache-dtype: auto | bfloat16 | fp8 | fp8_e4m3 (memory/kv_format.py)

    def _check_quantization(self) -> None:
        from engine.loader.kept_linear import check_quantization
        check_quantization(self.quantization)

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range."""
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "device must be one of auto, cpu, cuda"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 16,
             "max_num_batched_tokens must be >= 16"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.max_n >= 1, "max_n must be >= 1"),
            (self.host_kv_blocks >= 0, "host_kv_blocks must be >= 0"),
            (self.kv_offload_gib >= 0, "kv_offload_gib must be >= 0"),
            (not (self.kv_offload_gib and self.host_kv_blocks),
             "give the host KV tier's size once: kv_offload_gib or host_kv_blocks"),

            (self.max_loras >= 1, "max_loras must be >= 1"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"),
            (1 <= self.max_lora_rank <= MAX_LORA_RANK, f"max_lora_rank must be in [1, {MAX_LORA_RANK}]"),
            (self.enable_lora or not self.lora_modules, "lora_modules needs enable_lora (--enable-lora)"),
            (len({name for name, _ in self.lora_modules}) == len(self.lora_modules),
             "lora_modules names must be distinct"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1"),
            (self.tensor_parallel_size == 1 or not self.enable_lora,
             "enable_lora with tensor_parallel_size > 1: LoRA adapters are not sharded across ranks"),
            (self.data_parallel_size >= 1, "data_parallel_size must be >= 1"),
            (0 <= self.data_parallel_rank < self.data_parallel_size,
             f"data_parallel_rank must be in [0, data_parallel_size) = [0, {self.data_parallel_size})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_quantization()
        is_fp8(self.kv_cache_dtype)
        if self.speculative_config is not None:
            try:
                self.speculative_config.validate()
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
        events = self.kv_events_config
        if events is not None:
            try:
                events.validate()
            except ValueError as e:
                raise ValueError(f"kv_events_config: {e}") from None
            if events.enabled and not self.enable_prefix_caching:
                raise ValueError("--kv-events-config: KV cache events describe the prefix cache, which "
                                 "--no-enable-prefix-caching turns off")
