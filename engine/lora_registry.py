"""The engine's LoRA adapters: names, ids and the executor's adapter slots (engine thread only, except
`read`).

Every adapter stays in host memory while it is loaded; at most `max_loras` are resident in the executor
(its slots: the GPU pool). `prepare(steps)` makes a step's adapters resident, taking free slots first and
then those of the least recently used adapters the step does not need, and returns the lora id -> slot map
ModelBatch.build turns into the per-token slot array. The scheduler never puts more than max_loras
adapters into one step, so a step always fits.

Each loaded adapter has an id, never reused: sequences carry it (Sequence.lora_id) and the prefix cache
salts its block hashes with it (memory/prefix_hash.py), so a block computed under one adapter is served
to no other, not even to a later adapter loaded under the same name. An unload while sequences use the
adapter waits for them: its name stops being admitted at once and the reply comes when the last of them
has ended (`after_step`). A load in place (vLLM's `load_inplace`) gives the name a new adapter and id at
once: new requests get the new weights, and the old adapter drains as an unload does, its running
requests ending on the weights they began with.
"""
from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from engine.lora import LoRAAdapter, LoRAError, load_adapter, lora_sites

log = logging.getLogger("openinfer.engine")
Reply = Callable[[LoRAError | None], None]


@dataclass
class _Unload:
    name: str
    replies: list[Reply] = field(default_factory=list)     # empty: replaced in place, no one waits


class LoRARegistry:
    def __init__(self, executor, max_loras: int, max_rank: int, in_use: Callable[[int], bool]):
        self.executor = executor
        self.sites = lora_sites(executor.model)
        self.num_layers = executor.config.num_hidden_layers
        self.max_loras, self.max_rank = max_loras, max_rank
        self.in_use = in_use                                  # lora id -> whether a sequence still uses it
        self.ids: dict[str, int] = {}                         # admitted names
        self.adapters: dict[int, LoRAAdapter] = {}            # every loaded adapter, draining ones too
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # resident: id -> slot, least recently used first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.unloading: dict[int, _Unload] = {}               # draining: id -> name, who waits
        self._next_id = 1
        self.loads = 0                                        # slot loads (misses), for tests and logs

    # -- any thread -------------------------------------------------------------------------------
    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter folder (the file work, off the engine thread)."""
        return load_adapter(name, path, self.sites, self.num_layers, self.max_rank)

    # -- engine thread ----------------------------------------------------------------------------
    def add(self, adapter: LoRAAdapter, replace: bool = False) -> int:
        """Register a read adapter under its name; LoRAError if that name is loaded, unless `replace`: then
        the adapter loaded under it drains (as an unload, no one waiting) and the name is this one's."""
        old = self.ids.get(adapter.name)
        if old is not None and not replace:
            raise LoRAError(f"LoRA adapter {adapter.name!r} is already loaded (load it with 'load_inplace' "
                            f"to replace it)")
        lora_id, self._next_id = self._next_id, self._next_id + 1
        self.ids[adapter.name] = lora_id
        self.adapters[lora_id] = adapter
        if old is not None:
            self.unloading[old] = _Unload(adapter.name)
            self.after_step()
        log.info("LoRA adapter %r %s (rank %d, %s) from %s", adapter.name, "loaded" if old is None else
                 "replaced in place", adapter.rank, ", ".join(adapter.modules), adapter.path)
        return lora_id

    def id_of(self, name: str) -> int | None:
        """The id of an admitted adapter name (None: unknown, or being unloaded)."""
        return self.ids.get(name)

    def remove(self, name: str, reply: Reply) -> None:
        """Stop admitting `name`; reply(None) once no sequence uses it (now, or from after_step), or
        reply(LoRAError 404) for a name that is not loaded."""
        lora_id = self.ids.pop(name, None)
        if lora_id is None:
            waiting = next((u for u in self.unloading.values() if u.name == name and u.replies), None)
            if waiting is None:
                reply(LoRAError(f"LoRA adapter {name!r} is not loaded", status=404))
            else:
                waiting.replies.append(reply)
            return
        self.unloading[lora_id] = _Unload(name, [reply])
        self.after_step()

    def after_step(self) -> None:
        """Finish the unloads whose adapter no sequence uses any more (its slot is freed; a later load
        into it is queued behind the steps already launched)."""
        for lora_id, u in list(self.unloading.items()):
            if self.in_use(lora_id):
                continue
            del self.unloading[lora_id]
            self.adapters.pop(lora_id)
            slot = self.slot_of.pop(lora_id, None)
            if slot is not None:
                self.free_slots.append(slot)
            log.info("LoRA adapter %r (id %d) unloaded", u.name, lora_id)
            for reply in u.replies:
                reply(None)

    def prepare(self, steps: Iterable) -> dict[int, int] | None:
        """The step's adapters resident (loaded into slots where they are not); lora id -> slot, or None
        when no step uses an adapter."""
        ids = {s.lora_id for s in steps if s.lora_id}
        if not ids:
            return None
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step with {len(ids)} LoRA adapters; the executor holds {self.max_loras}")
        for lora_id in ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            slot = self.free_slots.pop() if self.free_slots else self._evict(ids)
            self.executor.set_lora(slot, self.adapters[lora_id])
            self.slot_of[lora_id] = slot
            self.loads += 1
        return {lora_id: self.slot_of[lora_id] for lora_id in ids}

    def _evict(self, keep: set[int]) -> int:
        victim = next(i for i in self.slot_of if i not in keep)
        return self.slot_of.pop(victim)


def lora_registry(executor, config, scheduler) -> LoRARegistry | None:
    """The registry of an engine with --enable-lora (None without), --lora-modules loaded; a bad module
    is refused at start (ValueError naming it). An adapter is in use while a waiting or running
    sequence of the scheduler carries its id."""
    if not config.enable_lora:
        return None
    slots = executor.options.max_loras
    if slots < config.max_loras:
        raise ValueError(f"max_loras={config.max_loras}: the executor holds {slots} LoRA slots")
    def in_use(lora_id: int) -> bool:
        return any(s.lora_id == lora_id for s in itertools.chain(scheduler.running, scheduler.waiting))

    registry = LoRARegistry(executor, config.max_loras, config.max_lora_rank, in_use)
    for name, path in config.lora_modules:
        try:
            registry.add(registry.read(name, path))
        except LoRAError as e:
            raise ValueError(f"--lora-modules: {e}") from None
    return registry
