"""The scheduler's part for a line's per-sequence state (memory/state_slots.py: the slot ids; the executor holds
the bytes). A sequence takes a slot when admitted and gives it back when it finishes, is aborted or is preempted
(it recomputes from zero state).

A line whose state a few recomputed tokens rebuild (`replay`: DeepSeek-V4's compressor rings) caches prefixes: a
hit restores the blocks' KV and the sequence computes again from replay(hit) tokens before the hit, those replayed
positions writing no KV (SeqStep.kv_from); its n > 1 samples fork after the prompt's prefill as a stateless line's
do, into slots held since admission, each child replaying into its own. A line whose state cannot be rebuilt
(Qwen3.5's linear attention) caches no prefixes (engine/engine_loop.py) and forks its samples before any prefill
(Sequence.fork_early). Without state slots (most lines) every method leaves the sequence as it is."""
from __future__ import annotations

from typing import Callable

from engine.sequence import Sequence
from memory.state_slots import StateSlots


class SequenceState:
    def __init__(self, slots: StateSlots | None, replay: Callable[[int], int] | None = None):
        self.slots = slots                   # None: the line keeps no per-sequence state
        self.replay = replay if slots is not None else None   # tokens recomputed before a hit (None: no replay)

    @property
    def forks_early(self) -> bool:
        """n > 1 samples fork before any prefill: their slots can be neither shared nor rebuilt from blocks."""
        return self.slots is not None and self.replay is None

    def has_room(self, seq: Sequence) -> bool:
        """Slots free for seq and its samples."""
        return self.slots is None or self.slots.num_free >= seq.fork_count

    def take(self, seq: Sequence) -> None:
        """seq's slot, and those of its samples when they fork after its prefill (held until the fork)."""
        if self.slots is not None:
            seq.state_slot = self.slots.allocate()
            if seq.fork_count > 1 and not seq.fork_early:
                seq.spare_slots = [self.slots.allocate() for _ in range(seq.fork_count - 1)]

    def release(self, seq: Sequence) -> None:
        for slot in [seq.state_slot] + seq.spare_slots:
            if slot >= 0:
                self.slots.free(slot)
        seq.state_slot, seq.spare_slots = -1, []

    def rebuild(self, seq: Sequence) -> None:
        """After a prefix hit of seq.num_computed tokens: their KV stays as restored (seq.kv_from: no step writes
        below it) and seq computes again from replay tokens before it, rebuilding its slot."""
        if self.replay is not None and seq.num_computed:
            seq.kv_from = seq.num_computed
            seq.num_computed -= self.replay(seq.num_computed)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child's slot: the one held for it since its parent's admission, rebuilt from the shared blocks, or a new
        one (a sample forked before any prefill)."""
        if parent.spare_slots:
            child.state_slot = parent.spare_slots.pop()
            self.rebuild(child)
        else:
            self.take(child)
