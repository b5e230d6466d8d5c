"""A KV event subscriber as a router written for vLLM has one: ZMQ SUB on the publisher's endpoint, a DEALER on
its replay endpoint, and vLLM's own event schema to decode with — re-declared below exactly as
vllm/distributed/kv_events.py (vLLM 0.24) declares it, so a payload this decodes strictly is one vLLM's
consumers decode."""
from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int        # vllm/v1/core/kv_cache_utils.py


# -- vllm/distributed/kv_events.py (v0.24.0), fields and struct options as vLLM declares them ------------
class EventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,
):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
# ----------------------------------------------------------------------------------------------------------

DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = -1


def events_config(port: int, replay_port: int | None = None, topic: str = "kv") -> dict:
    """--kv-events-config's fields for a publisher on `port` (and its replay socket on replay_port)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": topic}
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return config


class Subscriber:
    """SUB to tcp://127.0.0.1:port on `topic`; received batches are kept in order as (seq, KVEventBatch)."""

    def __init__(self, port: int, topic: str = "kv", replay_port: int | None = None):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.topic, self.replay_port = topic.encode(), replay_port
        self.received: list[tuple[int, KVEventBatch]] = []
        self.payloads: dict[int, bytes] = {}
        time.sleep(0.3)                    # a SUB's subscription takes a moment to reach the publisher

    def poll(self, timeout_s: float = 0.5) -> list[tuple[int, KVEventBatch]]:
        """Batches that arrive within timeout_s of each other (the new ones)."""
        new = []
        while self.sub.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            item = (int.from_bytes(seq, "big"), DECODER.decode(payload))
            assert msgspec.msgpack.encode(item[1]) == payload      # byte for byte what vLLM's structs encode
            self.payloads[item[0]] = payload
            new.append(item)
        self.received += new
        return new

    def wait(self, predicate, timeout_s: float = 30.0) -> list[tuple[int, KVEventBatch]]:
        """Poll until predicate(events received so far, flattened) holds; the batches received meanwhile."""
        deadline, new = time.monotonic() + timeout_s, []
        while not predicate(self.events()):
            assert time.monotonic() < deadline, f"no such events within {timeout_s} s: {self.events()}"
            new += self.poll(0.2)
        return new

    def events(self) -> list:
        return [e for _, batch in self.received for e in batch.events]

    def replay(self, start: int, request: list[bytes] | None = None) -> list[tuple[int, bytes]]:
        """(seq, payload) of every batch the replay socket answers from `start` on, up to its end marker."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart(request or [b"", start.to_bytes(8, "big")])
        out = []
        try:
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                frames = dealer.recv_multipart()
                assert len(frames) == 4 and frames[0] == b"", frames     # (b"", topic, seq, payload)
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    assert frames[1] == b"" and frames[3] == b""
                    return out
                assert frames[1] == self.topic
                out.append((seq, frames[3]))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
