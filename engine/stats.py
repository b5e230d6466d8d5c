"""The engine's counters and gauges, published after every step (EngineHandle.stats, /metrics)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    num_running: int = 0                # sequences
    num_waiting: int = 0
    num_requests: int = 0               # requests in flight
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0       # prompt tokens looked up
    prefix_cache_hits: int = 0          # of which were cached
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_steps_planned_ahead: int = 0    # decode steps scheduled while the previous one ran
    num_prompts_admitted_ahead: int = 0  # prompts joining such a step (async scheduling's mixed steps)
    host_kv_stored_blocks: int = 0      # host KV tier: evicted blocks kept, blocks copied back
    host_kv_restored_blocks: int = 0
    prefix_cache_host_hits: int = 0     # of prefix_cache_hits, tokens restored from the host tier
    host_kv_offload_bytes: int = 0      # KV bytes copied device -> host and host -> device (the rank's share)
    host_kv_restore_bytes: int = 0
    host_kv_copy_seconds: float = 0.0   # host time queuing the tier's copies (they run ahead of the step)
    lora_max_adapters: int = 0          # LoRA (0: off): adapter slots on the device (--max-loras), adapters
    lora_adapters_loaded: int = 0       # loaded (draining ones too), resident in slots, slot loads so far
    lora_adapters_resident: int = 0
    lora_slot_loads: int = 0
    lora_running_adapters: str = ""     # the names running / waiting sequences use, comma-separated
    lora_waiting_adapters: str = ""     # (vLLM's lora_requests_info labels)
    spec_decode_num_drafts: int = 0     # speculative decoding (vLLM's spec_decode_*): verify steps with drafts
    spec_decode_num_draft_tokens: int = 0   # (one per sequence and step), draft tokens verified, accepted,
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()   # accepted by position in the draft (() while off)
    warming_up: int = 1                 # 1 while the executor still captures graphs in idle moments (healthy
                                        # before that: the first requests may wait on a capture), then 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def by_name(self) -> dict[str, int | float | str | tuple[int, ...]]:
        """Every field, then the derived figures (kv_usage, prefix_cache_hit_rate), by name (/metrics)."""
        return {**asdict(self), "kv_usage": self.kv_usage, "prefix_cache_hit_rate": self.prefix_cache_hit_rate}
