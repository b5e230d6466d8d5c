"""LoopOptions: the engine loop's settings, resolved once at start from EngineConfig and the step limits
the executor was built for (engine/limits.py). The loop and the parts it builds (scheduler, admission,
LoRA registry, host tier, KV events, step trace) read these, never EngineConfig.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv_events import KVEventsConfig
from engine.limits import StepLimits, limits_within
from engine.speculative import SpeculativeConfig


@dataclass(frozen=True)
class LoopOptions:
    """EngineConfig's fields of the same names (engine/config.py), resolved: max_n capped by max_num_seqs,
    async_scheduling only with overlap_steps, max_loras 0 without enable_lora."""
    limits: StepLimits
    enable_prefix_caching: bool = True
    host_kv_blocks: int = 0
    kv_events_config: KVEventsConfig | None = None
    max_n: int = 16
    seed: int = 0
    overlap_steps: bool = True
    schedule_ahead: bool = True
    async_scheduling: bool = True
    step_trace: str | None = None
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    speculative_config: SpeculativeConfig | None = None
    data_parallel_rank: int = 0

    @classmethod
    def of(cls, config, limits: StepLimits) -> "LoopOptions":
        return cls(limits, enable_prefix_caching=config.enable_prefix_caching, host_kv_blocks=config.host_kv_blocks,
                   kv_events_config=config.kv_events_config, max_n=min(config.max_n, limits.max_num_seqs),
                   seed=config.seed, overlap_steps=config.overlap_steps, schedule_ahead=config.schedule_ahead,
                   async_scheduling=config.async_scheduling and config.overlap_steps,
                   step_trace=config.step_trace, enable_lora=config.enable_lora,
                   max_loras=config.max_loras if config.enable_lora else 0, max_lora_rank=config.max_lora_rank,
                   max_cpu_loras=config.max_cpu_loras, lora_modules=tuple(config.lora_modules),
                   speculative_config=config.speculative_config, data_parallel_rank=config.data_parallel_rank)


def options_within(executor_options, config, max_model_len: int) -> LoopOptions:
    """The options of an engine over an executor built elsewhere: the config's settings within the limits
    the executor was built for (engine/limits.py limits_within)."""
    return LoopOptions.of(config, limits_within(executor_options, config, max_model_len))
