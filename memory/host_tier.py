"""The host KV tier's slot map: which prefix-cache blocks live in host memory, in which slot (the scheduler's
host tier part, engine/host_tier.py, drives it and hands the copies to the executor).

When the device pool evicts a cached block (BlockManager's BlockRemoved), its KV is copied into a
host slot under the same hash instead of being lost; a later sequence whose prefix runs past the
device hits continues its hit in this tier, and those blocks are copied back into fresh device
blocks before the step that needs them (the scheduler decides, the executor copies: the bytes live
with the executor, next to its KV pool). Slots are reused least-recently-used first; a slot that a
restore of the current step reads is pinned until the step's copies are issued (`end_step`), and one
an asynchronous restore reads (the executor copies on its own stream, the sequence waits in the LOADING
state) is held until those copies land (`hold` / `release`). With asynchronous copies the tier is also
written through (`store_through`): a block that joins the device prefix cache gets its slot and copy at
once, the slot held and left out of lookups until that copy lands (`done_writing`).

Per step the scheduler hands the executor two lists, run in this order before the step's compute:
offloads (device block -> host slot), then restores (host slot -> device block), so a block both
evicted and re-used in one step is saved before it is overwritten. `on_move(hash, stored)`, where set, is
told of every hash the tier takes in and every one it drops (the KV events' host medium).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from memory.prefix_hash import longest_prefix


class HostKVTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"host KV tier needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._held: dict[int, int] = {}                         # slot -> holds across steps (async restores)
        self.offloads: list[tuple[int, int]] = []              # this step's (device block, host slot)
        self._offload_hashes: list[int] = []                   # the hash of each of this step's offloads
        self.restores: list[tuple[int, int]] = []              # this step's (host slot, device block)
        self.through: list[tuple[int, int]] = []               # this step's write-through (device block, host slot)
        self._writing: set[int] = set()                        # slots whose write-through has not landed
        self.stored_blocks = 0                                 # lifetime counters
        self.restored_blocks = 0
        self.on_move: Callable[[int, bool], None] | None = None

    def store(self, block_hash: int, device_block: int) -> None:
        """A cached device block is being evicted: keep its KV under its hash (a copy this step)."""
        slot = self._new_slot(block_hash)
        if slot is not None:
            self.offloads.append((device_block, slot))
            self._offload_hashes.append(block_hash)

    def _new_slot(self, block_hash: int) -> int | None:
        """A slot for a hash not held here yet (counted as stored); None where it is here already (made
        the most recently used) or every slot is pinned or held (the block is dropped)."""
        if block_hash in self.slot_of:
            self.slot_of.move_to_end(block_hash)
            return None
        slot = self._take_slot()
        if slot is not None:
            self.slot_of[block_hash] = slot
            self.stored_blocks += 1
            if self.on_move is not None:
                self.on_move(block_hash, True)
        return slot

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for victim, slot in self.slot_of.items():
            if slot not in self._pinned and slot not in self._held:
                del self.slot_of[victim]
                if self.on_move is not None:
                    self.on_move(victim, False)
                return slot
        return None

    def lookup(self, block_hashes: list[int]) -> list[int]:
        """Slots of the longest prefix of these hashes held here (no state change), up to the first whose
        write-through copy has not landed."""
        slots = longest_prefix(self.slot_of, block_hashes)
        if self._writing:
            slots = slots[:next((i for i, s in enumerate(slots) if s in self._writing), len(slots))]
        return slots

    def store_through(self, block_hash: int, device_block: int) -> int | None:
        """Write-through: a block just joined the device prefix cache, so its KV goes to a host slot now,
        off the critical path (an eviction later copies nothing). Returns the slot, held and kept out of
        lookups until done_writing; None where the hash is here already or every slot is taken."""
        slot = self._new_slot(block_hash)
        if slot is not None:
            self.through.append((device_block, slot))
            self._writing.add(slot)
            self.hold([slot])
        return slot

    def done_writing(self, slots: list[int]) -> None:
        """These write-through copies have landed: the slots serve lookups and may be reused again."""
        self._writing.difference_update(slots)
        self.release(slots)

    def take_through(self) -> list[tuple[int, int]]:
        """This step's write-through copies, handed to the executor."""
        out, self.through = self.through, []
        return out

    def restore(self, block_hash: int, slot: int, device_block: int) -> None:
        """Copy this slot into device_block before the step; the slot stays (and is pinned this step)."""
        self.restore_many([block_hash], [slot], [device_block])

    def restore_many(self, block_hashes: list[int], slots: list[int], device_blocks: list[int]) -> None:
        """restore() of each (hash, slot, block) in order, in one pass (a 16k-token prompt is ~1,000)."""
        self._pinned.update(slots)
        move = self.slot_of.move_to_end
        for block_hash in block_hashes:
            move(block_hash)
        self.restores.extend(zip(slots, device_blocks))
        self.restored_blocks += len(slots)

    def pin(self, slots: list[int]) -> None:
        """Keep these slots from reuse until end_step (an admission about to restore them)."""
        self._pinned.update(slots)

    def hold(self, slots: list[int]) -> None:
        """Keep these slots from reuse past this step, until release(): an asynchronous restore reads them
        until its copies land (the scheduler releases them then)."""
        for slot in slots:
            self._held[slot] = self._held.get(slot, 0) + 1

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            n = self._held.get(slot, 0) - 1
            if n > 0:
                self._held[slot] = n
            else:
                self._held.pop(slot, None)

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (offloads, restores), handed to the executor; unpins every slot."""
        self._slots_in_block_order()
        out = (self.offloads, self.restores)
        self.offloads, self.restores, self._offload_hashes = [], [], []
        self._pinned.clear()
        return out

    def _slots_in_block_order(self) -> None:
        """Deal this step's new slots out again in the order of their device blocks (a pool evicts a
        sequence's blocks tail first, so they arrive in reverse): consecutive blocks then go to
        consecutive slots, one run and one copy (memory/host_kv_copy.py), and a later restore of the
        prefix reads ascending slots. The step's restores of a slot stored this step follow it; a slot
        taken twice this step keeps the order as it is."""
        slots = sorted(slot for _, slot in self.offloads)
        if len(slots) < 2 or len(set(slots)) < len(slots):
            return
        order = sorted(range(len(self.offloads)), key=lambda i: self.offloads[i][0])
        new = {self.offloads[i][1]: slot for i, slot in zip(order, slots)}
        for block_hash, (_, slot) in zip(self._offload_hashes, self.offloads):
            self.slot_of[block_hash] = new[slot]
        self.offloads = [(block, new[slot]) for block, slot in self.offloads]
        self.restores = [(new.get(slot, slot), block) for slot, block in self.restores]
