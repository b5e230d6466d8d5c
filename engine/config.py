"""EngineConfig: everything that shapes one engine instance (model, device, batch and KV limits)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Names follow vLLM's engine arguments where vLLM has one.

    model: an HF model folder or a .gguf file; None serves the built-in demo model.
    max_model_len: prompt + output token limit per sequence; None takes the model's own limit.
    num_kv_blocks: size of the paged KV pool in 16-token blocks; None lets the executor size
    it (from gpu_memory_utilization on the GPU).
    """
    model: str | None = None
    device: str = "auto"                     # "auto" | "cpu" | "cuda"
    dtype: str = "auto"                      # "auto" | "bfloat16" | "float16" | "float32"
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_n: int = 16                          # largest n (samples per request) accepted
    seed: int = 0                            # seeds the RNG of requests that bring no seed
    overlap_steps: bool = True               # detokenize / send step N's tokens while step N+1 runs
    schedule_ahead: bool = True              # with overlap_steps: plan decode step N+1 while step N runs
    host_kv_blocks: int = 0                  # host KV tier: evicted prefix-cache blocks kept in host memory

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range."""
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "device must be one of auto, cpu, cuda"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 16, "max_num_batched_tokens must be >= 16"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.max_n >= 1, "max_n must be >= 1"),
            (self.host_kv_blocks >= 0, "host_kv_blocks must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
