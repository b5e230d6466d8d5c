"""The engine's LoRA adapters: names, ids and the executor's adapter slots (engine thread only, except
`read`).

At most `max_loras` adapters are resident in the executor (its slots: the GPU pool) and at most
`max_cpu_loras` in host memory (None: every loaded one; vLLM's --max-cpu-loras), the least recently used
out first, never one a waiting or running sequence uses (so the bound is exceeded while they all are). A
request for an adapter out of host memory waits while a thread reads its folder again (`fetch`; the
engine admits it then, or rejects it naming the read's error). `prepare(steps)` makes a step's adapters
resident, taking free slots first and then those of the least recently used adapters the step does not
need, and returns the lora id -> slot map ModelBatch.build turns into the per-token slot array. The
scheduler never puts more than max_loras adapters into one step, so a step always fits.

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
import threading
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
    def __init__(self, executor, max_loras: int, max_rank: int, in_use: Callable[[], set[int]],
                 max_cpu_loras: int | None = None):
        self.executor = executor
        self.sites = lora_sites(executor.model)
        self.num_layers = executor.config.num_hidden_layers
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.in_use = in_use                                  # the lora ids waiting or running sequences use
        self.ids: dict[str, int] = {}                         # admitted names
        self.loaded: dict[int, tuple[str, str]] = {}          # every loaded adapter (draining too): name, folder
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()    # those read into host memory, LRU first
        self.fetching: dict[int, list[Reply]] = {}            # re-reads under way: who waits for each
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
        self.loaded[lora_id] = (adapter.name, adapter.path)
        self.host[lora_id] = adapter
        self._trim()
        if old is not None:
            self.unloading[old] = _Unload(adapter.name)
            self.after_step()
        log.info("LoRA adapter %r %s (rank %d, %s) from %s", adapter.name, "loaded" if old is None else
                 "replaced in place", adapter.rank, ", ".join(adapter.modules), adapter.path)
        return lora_id

    def id_of(self, name: str) -> int | None:
        """The id of an admitted adapter name (None: unknown, or being unloaded)."""
        return self.ids.get(name)

    def in_host(self, name: str) -> bool:
        """Whether the admitted adapter `name` is in host memory (a request for it can be admitted now)."""
        return self.ids.get(name) in self.host

    def fetch(self, name: str, reply: Reply, call: Callable[[Callable[[], None]], None]) -> None:
        """Read the admitted adapter `name` into host memory again, on a thread of its own; reply(None or
        the LoRAError) on the engine thread (through `call`) once it is there, before anything is evicted."""
        lora_id = self.ids[name]
        if lora_id in self.fetching:
            self.fetching[lora_id].append(reply)
            return
        self.fetching[lora_id] = [reply]
        path = self.loaded[lora_id][1]

        def read() -> None:
            try:
                adapter, err = self.read(name, path), None
            except LoRAError as e:
                adapter, err = None, e
            except Exception as e:            # noqa: BLE001 - the waiting requests get it as their error
                adapter, err = None, LoRAError(f"LoRA adapter {name!r}: reading {path} failed: {e}", 500)
            call(lambda: self._fetched(lora_id, adapter, err))

        threading.Thread(target=read, name="openinfer-lora-fetch", daemon=True).start()

    def _fetched(self, lora_id: int, adapter: LoRAAdapter | None, err: LoRAError | None) -> None:
        if adapter is not None and lora_id in self.loaded:
            self.host[lora_id] = adapter
            log.info("LoRA adapter %r read into host memory again", adapter.name)
        for reply in self.fetching.pop(lora_id, []):
            reply(err)
        self._trim()

    def _trim(self) -> None:
        """Host memory down to max_cpu_loras adapters where those in use allow, least recently used out."""
        if self.max_cpu_loras is None or len(self.host) <= self.max_cpu_loras:
            return
        used = self.in_use()
        for lora_id in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                return
            if lora_id not in used:
                del self.host[lora_id]

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
        used = self.in_use() if self.unloading else set()
        for lora_id, u in list(self.unloading.items()):
            if lora_id in used:
                continue
            del self.unloading[lora_id]
            self.loaded.pop(lora_id)
            self.host.pop(lora_id, None)
            slot = self.slot_of.pop(lora_id, None)
            if slot is not None:
                self.free_slots.append(slot)
            log.info("LoRA adapter %r (id %d) unloaded", u.name, lora_id)
            for reply in u.replies:
                reply(None)
        self._trim()                            # adapters in use when read may be done with

    def prepare(self, steps: Iterable) -> dict[int, int] | None:
        """The step's adapters resident (loaded into slots where they are not); lora id -> slot, or None
        when no step uses an adapter."""
        ids = {s.lora_id for s in steps if s.lora_id}
        if not ids:
            return None
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step with {len(ids)} LoRA adapters; the executor holds {self.max_loras}")
        for lora_id in ids:
            if lora_id in self.host:
                self.host.move_to_end(lora_id)
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            slot = self.free_slots.pop() if self.free_slots else self._evict(ids)
            self.executor.set_lora(slot, self.host[lora_id])      # in host: a used adapter is never trimmed
            self.slot_of[lora_id] = slot
            self.loads += 1
        return {lora_id: self.slot_of[lora_id] for lora_id in ids}

    def names(self, ids: set[int]) -> str:
        """The loaded adapters' names of `ids` (0 and unknown ids skipped), sorted and comma-separated (a set:
        the stats ask after every step, for every sequence)."""
        return ",".join(sorted({self.loaded[i][0] for i in ids if i in self.loaded}))

    def _evict(self, keep: set[int]) -> int:
        victim = next(i for i in self.slot_of if i not in keep)
        return self.slot_of.pop(victim)


def lora_registry(executor, config, scheduler) -> LoRARegistry | None:
    """The registry of an engine with --enable-lora (None without), --lora-modules loaded; a bad module
    is refused at start (ValueError naming it). An adapter is in use while a waiting, running or loading
    (host-tier restores in flight) sequence of the scheduler carries its id."""
    if not config.enable_lora:
        return None
    slots = executor.options.max_loras
    if slots < config.max_loras:
        raise ValueError(f"max_loras={config.max_loras}: the executor holds {slots} LoRA slots")
    def in_use() -> set[int]:
        seqs = itertools.chain(scheduler.running, scheduler.waiting, scheduler.loading)
        return {s.lora_id for s in seqs if s.lora_id}

    registry = LoRARegistry(executor, config.max_loras, config.max_lora_rank, in_use, config.max_cpu_loras)
    for name, path in config.lora_modules:
        try:
            registry.add(registry.read(name, path))
        except LoRAError as e:
            raise ValueError(f"--lora-modules: {e}") from None
    return registry
