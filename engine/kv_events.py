"""KV cache events for a KV-aware router: vLLM's `--kv-events-config` and the engine thread's side of it.

The block manager's transitions (a block joining the prefix cache, a cached block evicted) and the host KV
tier's (a hash stored in a host slot, a slot's hash dropped) land here as small entries appended to a list,
on the engine thread; once per engine loop iteration `flush` hands that list to the publisher
(engine/kv_event_publisher.py), whose thread turns it into vLLM's msgpack batches on a ZMQ PUB socket.
A prefix-cache reset that leaves no block cached (and no host tier to move blocks to) is one
AllBlocksCleared, as vLLM's reset is; otherwise the reset is what it does, block by block.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

from engine.json_flag import json_object
from memory.block_manager import BlockManager, BlockRemoved, BlockStored
from memory.host_tier import HostKVTier

MEDIUM_GPU = "GPU"          # vLLM's `medium` of the device pool (vllm/distributed/kv_events.py) ...
MEDIUM_CPU = "CPU"          # ... and of its CPU offloading tier
EXTRA = "kv-events"         # the install extra that brings pyzmq and msgspec
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class HostMove(NamedTuple):
    """The host tier took (stored) or dropped a block's hash."""
    block_hash: int
    stored: bool


CLEARED = "AllBlocksCleared"
Entry = BlockStored | BlockRemoved | HostMove | str


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (vllm/config/kv_events.py), field for field: publisher None means "zmq" when
    events are on, "null" otherwise; buffer_steps batches are kept for replay; hwm is the PUB socket's
    high-water mark (0: none); max_queue_size batches may wait for the publisher thread (0: no bound)."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse --kv-events-config's JSON object; ValueError saying what is wrong."""
        raw = json_object(text)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(known)})")
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        """ValueError naming the field and what it takes."""
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)
        checks = [
            (isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events must be true or false"),
            (self.publisher in (None, "null", "zmq"), "publisher must be \"zmq\" or \"null\""),
            (isinstance(self.endpoint, str) and self.endpoint.startswith(ENDPOINT_SCHEMES),
             f"endpoint must be a ZMQ address ({', '.join(ENDPOINT_SCHEMES)}...)"),
            (self.replay_endpoint is None or (isinstance(self.replay_endpoint, str)
                                              and self.replay_endpoint.startswith(ENDPOINT_SCHEMES)),
             f"replay_endpoint must be null or a ZMQ address ({', '.join(ENDPOINT_SCHEMES)}...)"),
            (self.replay_endpoint is None or self.replay_endpoint != self.endpoint,
             "replay_endpoint must differ from endpoint"),
            (is_int(self.buffer_steps) and self.buffer_steps >= 1, "buffer_steps must be an integer >= 1"),
            (is_int(self.hwm) and self.hwm >= 0, "hwm must be an integer >= 0"),
            (is_int(self.max_queue_size) and self.max_queue_size >= 0, "max_queue_size must be an integer >= 0"),
            (isinstance(self.topic, str), "topic must be a string"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.enabled:
            require_publisher_deps()


def require_publisher_deps() -> None:
    """ValueError naming the install extra where pyzmq or msgspec is missing."""
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(f"KV cache events are published with pyzmq and msgspec, and {e.name} is not "
                         f"installed: pip install 'openinfer[{EXTRA}]'") from None


class KVEventLog:
    """The engine thread's record of the prefix cache's changes since the last flush (appends only)."""

    def __init__(self, publisher, lora_name: Callable[[int], str | None]):
        self.publisher = publisher            # publish(ts, entries, lora_names) / shutdown()
        self.lora_name = lora_name
        self.entries: list[Entry] = []
        self.lora_names: dict[int, str | None] = {}     # adapter id -> name, as each was first cached under
        self._reset_at: int | None = None

    def attach(self, bm: BlockManager, tier: HostKVTier | None) -> None:
        """Subscribe to the block manager (before the scheduler does: an eviction is recorded before the
        host tier's store that it causes) and to the host tier."""
        bm.subscribe(self._on_block, stored=True)
        if tier is not None:
            tier.on_move = self._on_host_move

    def _on_block(self, event: BlockStored | BlockRemoved) -> None:
        self.entries.append(event)
        if isinstance(event, BlockStored) and event.adapter_id and event.adapter_id not in self.lora_names:
            self.lora_names[event.adapter_id] = self.lora_name(event.adapter_id)

    def _on_host_move(self, block_hash: int, stored: bool) -> None:
        self.entries.append(HostMove(block_hash, stored))

    def begin_reset(self) -> None:
        self._reset_at = len(self.entries)

    def end_reset(self, cleared: bool) -> None:
        """cleared: the reset left nothing cached anywhere: its removals become one AllBlocksCleared."""
        if cleared and self._reset_at is not None:
            del self.entries[self._reset_at:]
            self.entries.append(CLEARED)
        self._reset_at = None

    def flush(self, ts: float) -> None:
        """Hand what was recorded to the publisher as one batch (nothing when nothing changed)."""
        if self.entries:
            entries, self.entries = self.entries, []
            self.publisher.publish(ts, entries, self.lora_names)    # (read by key only: no copy)

    def close(self, ts: float) -> None:
        self.flush(ts)
        self.publisher.shutdown()


def kv_event_log(config: KVEventsConfig | None, bm: BlockManager, tier: HostKVTier | None,
                 lora_name: Callable[[int], str | None], data_parallel_rank: int = 0) -> KVEventLog | None:
    """The engine's event log with its publisher bound (ValueError where its endpoints cannot be bound),
    attached to bm and tier; None where events are off."""
    if config is None or not config.enabled:
        return None
    if not bm.enable_prefix_caching:
        raise ValueError("--kv-events-config: KV cache events describe the prefix cache, which is off for this "
                         "model (its per-sequence linear-attention state is not kept with cached blocks)")
    from engine.kv_event_publisher import ZmqEventPublisher
    log = KVEventLog(ZmqEventPublisher(config, data_parallel_rank), lora_name)
    log.attach(bm, tier)
    return log
