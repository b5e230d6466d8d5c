"""Which data-parallel replica (engine/process_replicas.py) serves a request: the least loaded one, unless a
replica holding a longer prefix of the prompt is nearly as idle.

Load: the replica's requests in flight (sent and not ended — running and waiting — counted here, where every
request is sent, so without the lag of the engines' stats) plus 3 × its waiting sequences as its last stats
say: vLLM's internal load balancer's score, 4 · waiting + running (DPLBAsyncMPClient in
vllm/v1/engine/core_client.py), whose queue weighs more than its batch.

Prefix affinity: each replica keeps the block-hash chains (memory/prefix_hash.py; 16-token blocks; a LoRA
adapter's name seeds its chain) of the prompts recently sent to it, in an LRU as large as its KV cache (device
blocks + host tier), the root of a chain kept longest, as the engine evicts. A prompt's match on a replica is
the number of its leading blocks found there. Among the replicas whose load is within max(2, 25 %) of the
least loaded, the longest match wins (ties: the least loaded); without a match, the least loaded.

Why this and not a hash of the prompt's first block: a shared system prompt fills the first blocks of every
conversation, so a first-block hash would send every conversation to one replica; the longest match tells them
apart by their own history, so a conversation's next turn goes where its previous turns' KV is. What it
costs: ~0.7 µs of hashing per 16 prompt tokens (the first MAX_BLOCKS blocks) and a dict lookup per matched
block per replica, on the server's event loop. What it does not see: the engines' own evictions (the LRU only
approximates them) and the KV of generated tokens (a next turn's prompt holds the reply, so its match stops
at the end of the previous prompt).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from memory.kv_pool import BLOCK_SIZE
from memory.prefix_hash import NO_PARENT, hash_chain

WAITING_WEIGHT = 3               # + 1 for being in flight: vLLM's 4 · waiting + running
AFFINITY_ABS, AFFINITY_REL = 2, 0.25
MAX_BLOCKS = 2048                # 32k tokens of a prompt are hashed at most


def load_score(in_flight: int, waiting: int) -> int:
    """A replica's load: requests in flight, their waiting ones (from its stats) weighing 4 in all."""
    return in_flight + WAITING_WEIGHT * min(waiting, in_flight)


def prompt_chain(prompt, lora_name: str | None = None) -> list[int]:
    """The hashes of the prompt's leading full blocks (at most MAX_BLOCKS), chained from the adapter's seed."""
    root = NO_PARENT
    if lora_name is not None:
        root = int.from_bytes(hashlib.blake2b(lora_name.encode(), digest_size=8).digest(), "little")
    return hash_chain(prompt[:MAX_BLOCKS * BLOCK_SIZE], BLOCK_SIZE, parent_hash=root)


class PrefixLRU:
    """One replica's recently sent block hashes, at most `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, chain: list[int]) -> int:
        """How many leading blocks of the chain are here."""
        n = 0
        for h in chain:
            if h not in self.blocks:
                break
            n += 1
        return n

    def add(self, chain: list[int]) -> None:
        """The chain's blocks, most recent last and its root most recent of all (evicted after its children)."""
        for h in reversed(chain):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Dispatcher:
    """Picks a replica per request (`choose`) and remembers what it sent where."""

    def __init__(self, capacities: list[int]):
        self.prefixes = [PrefixLRU(c) for c in capacities]
        self._next = 0               # equal loads: the replicas in turn

    def choose(self, chain: list[int], loads: list[int | None]) -> int:
        """The replica for a prompt of this chain, given each replica's load (None: not serving)."""
        n = len(loads)
        ready = [r for r, load in enumerate(loads) if load is not None]
        if not ready:
            raise RuntimeError("no engine process is serving")
        order = sorted(ready, key=lambda r: (loads[r], (r - self._next) % n))
        best = order[0]
        if chain:
            limit = loads[best] + max(AFFINITY_ABS, AFFINITY_REL * loads[best])
            matches = {r: self.prefixes[r].match(chain) for r in order if loads[r] <= limit}
            longest = max(matches.values())
            if longest > matches[best]:
                best = next(r for r in order if matches.get(r) == longest)
        self._next = (best + 1) % n
        self.prefixes[best].add(chain)
        return best

    def pinned(self, rank: int, chain: list[int]) -> int:
        """A request sent to a replica it named (vLLM's X-data-parallel-rank): remembered there."""
        self.prefixes[rank].add(chain)
        return rank

    def forget(self) -> None:
        """The prefix caches were reset: nothing is known to be cached anywhere."""
        for lru in self.prefixes:
            lru.blocks.clear()
