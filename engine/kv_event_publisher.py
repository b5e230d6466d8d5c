"""The KV event publisher: vLLM's wire format on ZMQ, so a router written for vLLM consumes openinfer unchanged.

Wire (vllm/distributed/kv_events.py, vLLM 0.24 onwards): every batch is one PUB message of three frames,
(topic, seq as 8 bytes big-endian, payload), seq counting batches from 0; the payload is msgspec's msgpack
of KVEventBatch, an array [ts, events, data_parallel_rank], each event a map tagged "type": "BlockStored"
(a run of blocks, each the previous one's child: their hashes, the first one's parent hash, their token
ids, block_size, lora_id / lora_name, medium, extra_keys, group_idx), "BlockRemoved" (hashes, medium),
"AllBlocksCleared". Hashes are the engine's own 64-bit prefix hashes (memory/prefix_hash.py) as msgpack
integers, as vLLM sends its own by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). medium is "GPU" for the
device pool, "CPU" for the host KV tier, whose stores carry the block's parent and tokens (vLLM's
self-describing offload events). With a replay endpoint, a ROUTER socket keeps the last buffer_steps
batches: a DEALER sends (b"", start seq as 8 bytes big-endian) and gets (b"", topic, seq, payload) for each
kept batch from start on, then (b"", b"", -1 as 8 signed bytes, b"") — the frames vLLM 0.26 and later send.

The engine thread only queues (ts, entries) per loop iteration (engine/kv_events.py); this module's thread
turns them into events, encodes, sends and answers replays.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import msgspec
import zmq

from engine.kv_events import CLEARED, MEDIUM_CPU, MEDIUM_GPU, Entry, HostMove, KVEventsConfig
from memory import block_manager as bm
from memory.kv_pool import BLOCK_SIZE
from memory.prefix_hash import NO_PARENT

log = logging.getLogger("openinfer.engine")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 2.0


# -- vLLM's event schema (vllm/distributed/kv_events.py), declared as vLLM declares it ----------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV cache event; msgspec tags it with its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
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
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- entries -> events -------------------------------------------------------------------------------------
class EventTranslator:
    """Turns the engine's entries into vLLM events: consecutive stored blocks of one chain become one
    BlockStored; a host-tier store is described by the block's parent and tokens, remembered from its
    device store for as long as either tier holds the hash."""

    def __init__(self):
        self.on_device: set[int] = set()
        self.on_host: set[int] = set()
        self.blocks: dict[int, bm.BlockStored] = {}      # hash -> its device store (parent, tokens, adapter)

    def events(self, entries: list[Entry], lora_names: dict[int, str | None]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        run: list[bm.BlockStored] = []
        gone: list[int] = []
        for e in entries:
            if isinstance(e, bm.BlockStored):
                if run and (e.parent_hash != run[-1].block_hash or e.adapter_id != run[-1].adapter_id):
                    out.append(stored_event(run, MEDIUM_GPU, lora_names))
                    run = []
                run.append(e)
                self.blocks[e.block_hash] = e
                self.on_device.add(e.block_hash)
                continue
            if run:
                out.append(stored_event(run, MEDIUM_GPU, lora_names))
                run = []
            out.append(self._other(e, lora_names, gone))
        if run:
            out.append(stored_event(run, MEDIUM_GPU, lora_names))
        for h in gone:                                     # after the batch: an eviction's host store follows it
            if h not in self.on_device and h not in self.on_host:
                self.blocks.pop(h, None)
        return out

    def _other(self, e: Entry, lora_names: dict[int, str | None], gone: list[int]) -> KVCacheEvent:
        if isinstance(e, bm.BlockRemoved):
            self.on_device.discard(e.block_hash)
            gone.append(e.block_hash)
            return BlockRemoved([e.block_hash], MEDIUM_GPU, group_idx=0)
        if isinstance(e, HostMove) and e.stored:
            self.on_host.add(e.block_hash)
            block = self.blocks.get(e.block_hash)
            if block is None:                              # not seen on the device: vLLM's bare offload event
                return BlockStored([e.block_hash], None, [], 0, None, MEDIUM_CPU, None, group_idx=0)
            return stored_event([block], MEDIUM_CPU, lora_names)
        if isinstance(e, HostMove):
            self.on_host.discard(e.block_hash)
            gone.append(e.block_hash)
            return BlockRemoved([e.block_hash], MEDIUM_CPU, group_idx=0)
        if e == CLEARED:
            gone.extend(self.on_device)
            self.on_device.clear()
            return AllBlocksCleared()
        raise TypeError(f"not a KV event entry: {e!r}")


def stored_event(run: list[bm.BlockStored], medium: str, lora_names: dict[int, str | None]) -> BlockStored:
    """One BlockStored for a chain of blocks (each the previous one's child), as vLLM's block pool sends."""
    first = run[0]
    lora = lora_names.get(first.adapter_id) if first.adapter_id else None
    tokens = [t for block in run for t in block.token_ids]
    return BlockStored(block_hashes=[block.block_hash for block in run],
                       parent_block_hash=None if first.parent_hash == NO_PARENT else first.parent_hash,
                       token_ids=tokens, block_size=BLOCK_SIZE, lora_id=first.adapter_id or None, medium=medium,
                       lora_name=lora, extra_keys=[None if lora is None else (lora,)] * len(run), group_idx=0)


# -- the sockets -------------------------------------------------------------------------------------------
def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank r, as vLLM derives it: a tcp port + r, any other address + _dp<r>."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, ipc or inproc address is bound, any other connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket (and ROUTER replay socket) fed from a queue by a thread of its own."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.rank = data_parallel_rank
        self.topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._translator = EventTranslator()
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._pub = self._socket(zmq.PUB, offset_endpoint_port(config.endpoint, self.rank), config.hwm)
        if config.replay_endpoint is not None:       # room for a whole replay and its end marker
            self._replay = self._socket(zmq.ROUTER, offset_endpoint_port(config.replay_endpoint, self.rank),
                                        2 * (config.buffer_steps + 1), replay=True)
        self._thread = threading.Thread(target=self._run, name="openinfer-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, endpoint: str, hwm: int, replay: bool = False) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, hwm)
        try:
            if replay or binds(endpoint):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self.close_sockets()
            what = "replay_endpoint" if replay else "endpoint"
            raise ValueError(f"--kv-events-config {what} {endpoint!r}: {e}") from None
        return sock

    def publish(self, ts: float, entries: list[Entry], lora_names: dict[int, str | None]) -> None:
        """Engine thread: queue one batch (blocks only while max_queue_size batches wait, as vLLM's does)."""
        self._queue.put((ts, entries, lora_names))

    def shutdown(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        self._queue.put(None)
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():       # its sockets stay open: the thread may still be using them
            log.warning("KV event publisher: %d batches still queued at shutdown", self._queue.qsize())
            return
        self.close_sockets()

    def close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encoder, seq = msgspec.msgpack.Encoder(), 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, entries, lora_names = item
            try:
                events = self._translator.events(entries, lora_names)
                payload = encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=self.rank))
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
            except Exception:             # one bad batch must not end the stream
                log.exception("KV event publisher: a batch could not be sent")

    def _serve_replay(self) -> None:
        """One replay request: every kept batch from the asked seq on, then the end marker."""
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV event replay: malformed request of %d frames", len(frames))
                return
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        except zmq.ZMQError:
            log.exception("KV event replay failed")
