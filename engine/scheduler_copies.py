"""The scheduler's side of the host KV tier (memory/host_tier.py decides which blocks move, the executor moves
the bytes): blocks the device evicts go to the tier; a prefix hit's host blocks come back into fresh device
blocks (`_restore`); with asynchronous copies the restores keep their sequence LOADING until they land, the
tier is written through as blocks join the device prefix cache (each block held until its copy lands), and
`land_copies` settles what has landed. Pure-host mode offloads a sequence's full blocks as it lets them go.
A mixin of engine/scheduler.py's Scheduler (its bm, host_tier, running, loading, state_slots)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sequence import Sequence, SeqStatus
from memory.block_manager import BlockRemoved, BlockStored
from memory.kv_pool import BLOCK_SIZE


@dataclass
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


class HostTierCopies:
    """Scheduler state it adds (Scheduler.__init__): _draining, _writing (Copies in flight), async_copies and
    copies_done (the executor's ticket poll)."""

    def _on_kv_event(self, event) -> None:
        if isinstance(event, BlockRemoved) and self.host_tier is not None:   # evicted: keep it on the host
            self.host_tier.store(event.block_hash, event.block_id)

    def enable_async_copies(self, copies_done: Callable[[object], bool]) -> None:
        """The executor copies asynchronously: restores through LOADING, and the tier written through."""
        self.async_copies, self.copies_done = True, copies_done
        self.bm.subscribe(self._on_block_stored, stored=True)

    def _on_block_stored(self, event) -> None:
        if isinstance(event, BlockStored) and self.host_tier is not None:
            slot = self.host_tier.store_through(event.block_hash, event.block_id)
            if slot is not None:
                self.bm.acquire([event.block_id])       # not evicted nor reused until its copy lands
                if not self._writing or self._writing[-1].issued:   # one record per issue: one ticket poll
                    self._writing.append(Copies([], []))
                self._writing[-1].blocks.append(event.block_id)
                self._writing[-1].slots.append(slot)

    def _restore(self, seq: Sequence, hashes: list[int], first: int, slots: list[int]) -> None:
        """Blocks first.. of seq's prefix come back from host slots into fresh device blocks, which
        join the device prefix cache under their hashes."""
        self.host_tier.pin(slots)                    # the allocation below may evict into the tier
        fresh = sorted(self.bm.allocate(len(slots)))
        rank = sorted(range(len(slots)), key=lambda j: slots[j])
        blocks = [0] * len(slots)                    # in slot order: consecutive slots -> consecutive blocks,
        for j, block in zip(rank, fresh):            # one copy for the run (memory/host_kv_copy.py)
            blocks[j] = block
        self.host_tier.restore_many(hashes[first:first + len(slots)], slots, blocks)
        seq.block_table += blocks
        if self.async_copies and seq.fork_count == 1 and self.state_slots is None:
            self.host_tier.hold(slots)               # read until the copies land
            seq.load = Copies(blocks, list(slots), first, hashes)
        else:
            self.bm.cache_blocks(blocks, hashes, first, seq.token_ids, seq.lora_id)

    def copies_issued(self, ticket: object, writes: bool = False) -> None:
        """The executor took this step's restores (writes: its write-through copies), ticket: copy_blocks'
        answer for copies_done. The two kinds land apart: a restore need not wait for a long offload."""
        for r in self._writing if writes else [seq.load for seq in self.loading] + self._draining:
            if not r.issued:
                r.issued, r.ticket = True, ticket

    def oldest_ticket(self) -> object:
        """The ticket of the oldest issued copies still in flight (what an engine with no step to run
        waits on: a loading sequence's, or a write-through's holding blocks), or None."""
        pending = [s.load for s in self.loading] + self._writing + self._draining
        return next((c.ticket for c in pending if c.issued and c.ticket is not None), None)

    def _landed(self, r: Copies) -> bool:
        return r.issued and (r.ticket is None or self.copies_done(r.ticket))

    def land_copies(self) -> None:
        """Loading sequences whose copies have landed join the running ones (their blocks join the prefix
        cache now); the blocks of sequences finished while loading are freed once theirs land, and those
        written through to the host once their copy lands (the engine calls this before each step's copies)."""
        if not (self.loading or self._draining or self._writing):
            return
        for c in [c for c in self._writing if self._landed(c)]:
            self._writing.remove(c)
            self.bm.free(c.blocks)
            if self.host_tier is not None:
                self.host_tier.done_writing(c.slots)
        for seq in [s for s in self.loading if self._landed(s.load)]:
            r, seq.load = seq.load, None
            self.bm.cache_blocks(r.blocks, r.hashes, r.first, seq.token_ids, seq.lora_id)
            self._release_slots(r)
            self.loading.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        for r in [r for r in self._draining if self._landed(r)]:
            self._draining.remove(r)
            self.bm.free(r.blocks)
            self._release_slots(r)

    def _release_slots(self, r: Copies) -> None:
        if self.host_tier is not None:           # (switched off after a failed copy: nothing to release)
            self.host_tier.release(r.slots)

    def _offload_before_free(self, seq: Sequence) -> None:
        """Pure-host mode (a host tier, prefix caching off): the device keeps no prefix, so the full blocks
        of KV a sequence computed go to the host tier as it lets them go (the copies run before the step
        that could reuse the blocks), where a later prompt with the same prefix finds them."""
        if self.host_tier is None or self.bm.enable_prefix_caching or seq.want_prompt_logprobs:
            return
        full = min(min(seq.num_computed, len(seq.token_ids)) // BLOCK_SIZE, len(seq.block_table))
        for block_hash, block in zip(seq.block_hashes(full), seq.block_table):
            self.host_tier.store(block_hash, block)
