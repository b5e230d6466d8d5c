"""The host KV tier, one part the scheduler owns: it decides which blocks move between the device pool and
host memory and tracks them until they land; the executor only moves the bytes (Executor.copy_blocks,
copies_done, wait_copies: the numpy arrays of engine/executor/cpu.py, the pinned slots and streams of
engine/executor/gpu_host_copies.py).

Which block lives in which host slot is the slot map (memory/host_tier.py HostKVTier). Here: blocks the device
evicts go to it (`_on_evicted`); a prefix hit's host blocks come back into fresh device blocks (`restore`);
pure-host mode (prefix caching off) offloads a sequence's full blocks as it lets them go (`offload_on_free`);
before each step the step's offloads, restores and write-throughs are handed to the executor (`issue`). With
asynchronous copies (the executor's supports_async_copies) a restore keeps its sequence LOADING until its
copies land, the tier is written through as blocks join the device prefix cache (each block held until its
copy lands), and `land` settles what has landed; the engine is not idle while copies in flight hold device
blocks (`holds_blocks`: the scheduler's has_work). A failed copy switches the tier off (`slots` None): what is
in flight still lands, nothing new is stored or looked up.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.sequence import Sequence
from memory.block_manager import BlockManager, BlockRemoved, BlockStored
from memory.host_tier import HostKVTier
from memory.kv_pool import BLOCK_SIZE

log = logging.getLogger("openinfer.engine")


@dataclass(eq=False)
class Copies:
    """Asynchronous host-tier copies in flight: the device blocks and host slots they touch, the
    executor's ticket once they are issued; for a restore of a sequence's prefix also where its blocks
    (the tail of its block table) sit in its hash chain."""
    blocks: list[int]
    slots: list[int]
    first: int = 0
    hashes: list[int] = field(default_factory=list)
    issued: bool = False
    ticket: object = None


def host_slots(executor, host_kv_blocks: int) -> HostKVTier | None:
    """The slot map over the host_kv_blocks slots the executor allocated (None: no tier); ValueError where
    the executor cannot hold them."""
    if not host_kv_blocks:
        return None
    if executor.num_state_slots and executor.replay_tokens is None:
        raise ValueError(f"host_kv_blocks={host_kv_blocks}: the host KV tier keeps prefix-cache blocks, and "
                         f"prefix caching is off for a model with per-sequence (linear-attention) state")
    if not executor.supports_host_tier:
        raise ValueError(f"host_kv_blocks={host_kv_blocks}: {type(executor).__name__} has no host KV tier")
    if executor.options.host_kv_blocks < host_kv_blocks:
        raise ValueError(f"host_kv_blocks={host_kv_blocks}: the executor holds "
                         f"{executor.options.host_kv_blocks} host KV slots")
    return HostKVTier(host_kv_blocks)


class HostTier:
    """slots: the slot map (None once a copy failed); bm: the device pool's block manager, whose evictions
    (and, with asynchronous copies, new cached blocks) it follows; executor: what moves the bytes."""

    def __init__(self, slots: HostKVTier, bm: BlockManager, executor):
        self.slots: HostKVTier | None = slots
        self.bm, self.executor = bm, executor
        self.async_copies = bool(executor.supports_async_copies)
        self.restoring: list[Copies] = []        # restores in flight of sequences LOADING (their seq.load)
        self.writing: list[Copies] = []          # write-through copies in flight
        self.draining: list[Copies] = []         # restores of sequences finished while loading
        self.copy_seconds = 0.0                  # host time in the executor's copy_blocks
        bm.subscribe(self._on_evicted, stored=False)
        if self.async_copies:
            bm.subscribe(self._on_block_stored, stored=True)

    @property
    def on(self) -> bool:
        return self.slots is not None

    @property
    def holds_blocks(self) -> bool:
        """Copies in flight still hold device blocks past their sequences: write-throughs, and restores of
        sequences finished while loading (the engine is not idle until they land and give them back)."""
        return bool(self.writing or self.draining)

    def lookup(self, hashes: list[int]) -> list[int]:
        """Host slots of the longest prefix of these hashes held on the host."""
        return self.slots.lookup(hashes) if self.slots is not None else []

    def stats(self, block_bytes: int) -> dict:
        """EngineStats' host-tier fields (the slot map's counters: 0 once a copy failed); block_bytes: one
        KV block's bytes."""
        stored, restored = (self.slots.stored_blocks, self.slots.restored_blocks) if self.on else (0, 0)
        return {"host_kv_stored_blocks": stored, "host_kv_restored_blocks": restored,
                "prefix_cache_host_hits": restored * BLOCK_SIZE, "host_kv_offload_bytes": stored * block_bytes,
                "host_kv_restore_bytes": restored * block_bytes, "host_kv_copy_seconds": self.copy_seconds}

    # -- what moves ------------------------------------------------------------------------
    def _on_evicted(self, event) -> None:
        if isinstance(event, BlockRemoved) and self.slots is not None:   # evicted: keep it on the host
            self.slots.store(event.block_hash, event.block_id)

    def _on_block_stored(self, event) -> None:
        if isinstance(event, BlockStored) and self.slots is not None:
            slot = self.slots.store_through(event.block_hash, event.block_id)
            if slot is not None:
                self.bm.acquire([event.block_id])       # not evicted nor reused until its copy lands
                if not self.writing or self.writing[-1].issued:   # one record per issue: one ticket poll
                    self.writing.append(Copies([], []))
                self.writing[-1].blocks.append(event.block_id)
                self.writing[-1].slots.append(slot)

    def restore(self, seq: Sequence, hashes: list[int], first: int, slots: list[int], may_load: bool) -> None:
        """Blocks first.. of seq's prefix come back from host slots into fresh device blocks, which join
        the device prefix cache under their hashes (with asynchronous copies and may_load, once they land:
        seq.load tracks them, the sequence waits LOADING)."""
        self.slots.pin(slots)                        # the allocation below may evict into the tier
        fresh = sorted(self.bm.allocate(len(slots)))
        rank = sorted(range(len(slots)), key=lambda j: slots[j])
        blocks = [0] * len(slots)                    # in slot order: consecutive slots -> consecutive blocks,
        for j, block in zip(rank, fresh):            # one copy for the run (memory/host_kv_copy.py)
            blocks[j] = block
        self.slots.restore_many(hashes[first:first + len(slots)], slots, blocks)
        seq.block_table += blocks
        if self.async_copies and may_load:
            self.slots.hold(slots)                   # read until the copies land
            seq.load = Copies(blocks, list(slots), first, hashes)
            self.restoring.append(seq.load)
        else:
            self.bm.cache_blocks(blocks, hashes, first, seq.token_ids, seq.lora_id)

    def offload_on_free(self, seq: Sequence) -> None:
        """Pure-host mode (a host tier, prefix caching off): the device keeps no prefix, so the full blocks
        of KV a sequence computed go to the host tier as it lets them go (the copies run before the step
        that could reuse the blocks), where a later prompt with the same prefix finds them."""
        if self.slots is None or self.bm.enable_prefix_caching or seq.want_prompt_logprobs:
            return
        full = min(min(seq.num_computed, len(seq.token_ids)) // BLOCK_SIZE, len(seq.block_table))
        for block_hash, block in zip(seq.block_hashes(full), seq.block_table):
            self.slots.store(block_hash, block)

    def drain(self, seq: Sequence) -> None:
        """A LOADING seq finishes: its blocks before the restored ones are freed now, the restored ones once
        their copies land (until then the copies still write them)."""
        r, seq.load = seq.load, None
        self.restoring.remove(r)
        self.draining.append(r)
        self.bm.free(seq.block_table[:len(seq.block_table) - len(r.blocks)])
        seq.block_table = []

    # -- issuing and landing -----------------------------------------------------------------
    def issue(self) -> None:
        """Before the step: the step's offloads of evicted blocks, then its restores, then (a ticket of their
        own: restores do not wait for them) its write-throughs, to the executor. A failing copy switches
        the tier off (its slots no longer hold what they claim) and raises."""
        offloads, restores = self.slots.end_step()
        through = self.slots.take_through()
        if not offloads and not restores and not through:
            return
        t = time.perf_counter()
        try:
            if offloads or restores:
                self._issued(self.executor.copy_blocks(offloads, restores))
            if through:
                self._issued(self.executor.copy_blocks([], [], through), writes=True)
            self.copy_seconds += time.perf_counter() - t
        except Exception:
            log.exception("host KV tier copy failed; the tier is switched off")
            self.slots = None
            self._issued(None)                   # (the failure fails the requests; their blocks come back)
            self._issued(None, writes=True)
            raise

    def _issued(self, ticket: object, writes: bool = False) -> None:
        """The executor took this step's restores (writes: its write-through copies), ticket: copy_blocks'
        answer for copies_done. The two kinds land apart: a restore need not wait for a long offload."""
        for r in self.writing if writes else self.restoring + self.draining:
            if not r.issued:
                r.issued, r.ticket = True, ticket

    def oldest_ticket(self) -> object:
        """The ticket of the oldest issued copies still in flight (what an engine with no step to run waits
        on: a loading sequence's, or a write-through's holding blocks), or None."""
        pending = self.restoring + self.writing + self.draining
        return next((c.ticket for c in pending if c.issued and c.ticket is not None), None)

    def wait_oldest(self) -> bool:
        """Block until the oldest issued copies still in flight have landed; False where none is."""
        ticket = self.oldest_ticket()
        if ticket is None:
            return False
        self.executor.wait_copies(ticket)
        return True

    def _landed(self, r: Copies) -> bool:
        return r.issued and (r.ticket is None or self.executor.copies_done(r.ticket))

    def land(self, loading: list[Sequence]) -> list[Sequence]:
        """Settle what has landed: blocks written through to the host are given back, those of sequences
        finished while loading freed; returns the loading sequences whose copies landed (their blocks
        joined the prefix cache)."""
        for c in [c for c in self.writing if self._landed(c)]:
            self.writing.remove(c)
            self.bm.free(c.blocks)
            if self.slots is not None:
                self.slots.done_writing(c.slots)
        landed = [s for s in loading if self._landed(s.load)]
        for seq in landed:
            r, seq.load = seq.load, None
            self.restoring.remove(r)
            self.bm.cache_blocks(r.blocks, r.hashes, r.first, seq.token_ids, seq.lora_id)
            self._release_slots(r)
        for r in [r for r in self.draining if self._landed(r)]:
            self.draining.remove(r)
            self.bm.free(r.blocks)
            self._release_slots(r)
        return landed

    def _release_slots(self, r: Copies) -> None:
        if self.slots is not None:               # (switched off after a failed copy: nothing to release)
            self.slots.release(r.slots)
