"""Per-sequence state slots: the fixed-size state a line keeps per sequence beside the paged KV (a hybrid
line's conv window and recurrent state, whose full-attention layers alone use the paged KV; DeepSeek-V4's
compressor rings, the compressor inputs of each compressed layer's last tokens).

A model line declares what one slot holds (`state_layout()`: a StateLayout of named arrays, each with
a leading layer axis); the executors allocate `num_slots` of them from the declaration, one array per
name shaped [layers, num_slots, *per_layer]: layer l of slot s is state[name][l, s]. The scheduler
owns the slot ids (StateSlots): a sequence takes one when it is admitted and gives it back when it
finishes, is aborted or is preempted. A slot's content is never reset by the allocator: the first
step of a sequence (start_pos 0) starts from zeros, so a preempted sequence recomputes from scratch.

Memory: Qwen3.5-4B (24 linear layers, conv 8192 x 3 in bf16, recurrent 32 x 128 x 128 in float32)
holds 24 x (48 KiB + 2 MiB) = 49.1 MiB per slot on the GPU; DeepSeek-V4-Flash's rings (21 CSA layers x 8 tokens
x 2,560 values, 20 HCA layers x 128 x 1,024, bf16) 5.8 MiB.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ACTIVATION = "activation"       # dtype tag: the executor's activation dtype (float32 CPU, bf16 GPU)


@dataclass(frozen=True)
class StateArray:
    """One named state array of a slot: `layers` layers of `shape` each, in `dtype` ("float32" or
    ACTIVATION)."""
    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: str = "float32"

    def itemsize(self, activation_itemsize: int) -> int:
        return activation_itemsize if self.dtype == ACTIVATION else np.dtype(self.dtype).itemsize

    def values(self) -> int:
        """Values one slot holds across every layer."""
        return self.layers * int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class StateLayout:
    """What one sequence's state slot holds, declared by the model line (`state_layout()`)."""
    arrays: tuple[StateArray, ...]

    def __post_init__(self):
        names = [a.name for a in self.arrays]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"state layout needs distinct array names, got {names}")
        if any(a.layers < 1 or min(a.shape, default=1) < 1 for a in self.arrays):
            raise ValueError(f"state layout needs positive sizes, got {self}")

    def slot_bytes(self, activation_itemsize: int) -> int:
        """Bytes of one slot (every array, every layer)."""
        return sum(a.values() * a.itemsize(activation_itemsize) for a in self.arrays)

    def shapes(self, num_slots: int) -> dict[str, tuple[int, ...]]:
        """name -> the pool array's shape [layers, num_slots, *shape]."""
        return {a.name: (a.layers, num_slots, *a.shape) for a in self.arrays}


def state_buffers(layout: StateLayout, num_slots: int) -> list:
    """The device buffers of num_slots slots (bf16 activation arrays as uint16), for the GPU arena."""
    from memory.device_arena import Buffer
    return [Buffer(a.name, shape, np.uint16 if a.dtype == ACTIVATION else np.dtype(a.dtype))
            for a, shape in zip(layout.arrays, layout.shapes(num_slots).values())]


def host_state(layout: StateLayout, num_slots: int) -> dict[str, np.ndarray]:
    """Zeroed float32 state arrays in host memory (the CPU executor computes in float32)."""
    return {name: np.zeros(shape, np.float32) for name, shape in layout.shapes(num_slots).items()}


def check_slots(slots: np.ndarray, num_slots: int) -> None:
    """A step's state slot ids must all be in [0, num_slots) (ValueError: a step the executor cannot take)."""
    if slots.size and not 0 <= int(slots.min()) <= int(slots.max()) < num_slots:
        raise ValueError(f"state slots {slots.tolist()} outside [0, {num_slots})")


class NoFreeSlots(RuntimeError):
    pass


class StateSlots:
    """Slot ids 0..num_slots-1, handed out lowest first (a decode step's slots stay dense)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))      # a stack: pop() gives the lowest id
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlots(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)
