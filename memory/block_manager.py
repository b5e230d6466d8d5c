"""Paged KV block manager: 16-token blocks, reference counts, prefix cache with LRU eviction.

A block is in exactly one state:
  free     refcount 0, no hash          (in `_free`, handed out first)
  cached   refcount 0, hash registered  (in `_lru`, reusable by a prefix hit, evicted LRU-first)
  in use   refcount > 0                 (held by one or more sequences; may also carry a hash)
Only full, computed blocks get a hash (`cache_block`); a hit hands the same block to another
sequence (refcount + 1), so shared blocks are never written again. Subscribers see
BlockStored when a block enters the cache and BlockRemoved when it is evicted from it.

Partial hits (`partial_hit`): where a prompt's hash chain stops, a cached block under the same parent
(and adapter) may still share the first k of the next block's tokens. The scheduler then gives the
sequence a fresh block, has the executor copy the cached block's KV into it before the sequence's
first step (copy-on-write: the shared block itself is never written), and computes from token k on.
A prompt sent again, or again with its last token changed, so computes one token, not up to 16.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice
from typing import Callable, NamedTuple

from memory.kv_pool import BLOCK_SIZE
from memory.prefix_hash import NO_PARENT, longest_prefix


class BlockStored(NamedTuple):          # (a NamedTuple: ~3x cheaper to build than a frozen dataclass, and
    block_hash: int                     # one is built per block cached while a subscriber wants them)
    parent_hash: int
    token_ids: tuple[int, ...]
    adapter_id: int
    block_id: int


class BlockRemoved(NamedTuple):
    block_hash: int
    block_id: int


KVEvent = BlockStored | BlockRemoved


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                     # hash -> block id
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()     # cached blocks with refcount 0
        self._subscribers: list[Callable[[KVEvent], None]] = []
        self._stored_subscribers: list[Callable[[KVEvent], None]] = []     # the ones that want BlockStored
        self.query_tokens = 0                                 # prefix-cache lookups, in tokens
        # partial hits: cached blocks by (parent hash, adapter), and where each one's tokens are
        self._children: dict[tuple[int, int], dict[int, None]] = {}
        self._origin: list[tuple[tuple[int, int], list[int], int] | None] = [None] * num_blocks
        self.hit_tokens = 0

    # -- observation ---------------------------------------------------------------------
    def subscribe(self, callback: Callable[[KVEvent], None], stored: bool = True) -> None:
        """callback(event) for every BlockRemoved and (with `stored`) BlockStored, on the engine thread.
        BlockStored carries the block's token ids: it is built only while someone wants it (a 16k-token
        restore caches ~1,000 blocks in one step)."""
        self._subscribers.append(callback)
        if stored:
            self._stored_subscribers.append(callback)

    def _emit(self, event: KVEvent) -> None:
        for callback in self._stored_subscribers if isinstance(event, BlockStored) else self._subscribers:
            callback(event)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # -- allocation ----------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1; evicts least-recently-used cached blocks if needed."""
        if n > self.num_free_blocks:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._lru.popitem(last=False)
                self._uncache(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def fork(self, blocks: list[int]) -> None:
        """Another sequence shares these blocks."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"fork of block {block} that is not in use")
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Tail blocks go first so that, under eviction,
        a prefix outlives its continuations."""
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise ValueError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._lru[block] = None

    # -- prefix cache --------------------------------------------------------------------
    def lookup(self, block_hashes: list[int]) -> list[int]:
        """Blocks of the longest cached prefix of this hash chain (no refcount change)."""
        return longest_prefix(self.cached, block_hashes) if self.enable_prefix_caching else []

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks found by lookup (a prefix hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                self._lru.pop(block)
            self.ref_counts[block] += 1

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def cache_block(self, block: int, block_hash: int, parent_hash: int, token_ids: list[int],
                    adapter_id: int = 0) -> None:
        """Register a full, computed block under its hash. A hash already cached in another
        block keeps that block; this one stays private."""
        if (self.enable_prefix_caching and self._register(block, block_hash, (parent_hash, adapter_id), token_ids, 0)
                and self._stored_subscribers):
            self._emit(BlockStored(block_hash, parent_hash, tuple(token_ids), adapter_id, block))

    def cache_blocks(self, blocks: list[int], chain: list[int], first: int, token_ids: list[int],
                     adapter_id: int = 0) -> None:
        """cache_block for blocks[k] holding block first + k of a sequence whose hash chain is `chain`
        (its parent chain[first + k - 1]) and tokens token_ids, in one pass: a block's tokens are sliced
        only for a BlockStored someone wants (a prefix restored from the host tier: ~1,000 blocks at 16k)."""
        if not self.enable_prefix_caching:
            return
        for k, block in enumerate(blocks):
            i = first + k
            parent = chain[i - 1] if i else NO_PARENT
            if self._register(block, chain[i], (parent, adapter_id), token_ids, i * BLOCK_SIZE) and self._stored_subscribers:
                self._emit(BlockStored(chain[i], parent,
                                       tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), adapter_id, block))

    def _register(self, block: int, block_hash: int, under: tuple[int, int], token_ids: list[int], at: int) -> bool:
        """block under block_hash, unless it has a hash already or another block holds that hash; `under`:
        (parent hash, adapter); its tokens are token_ids[at:at + BLOCK_SIZE] (kept by reference)."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return False
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        self._children.setdefault(under, {})[block] = None
        self._origin[block] = (under, token_ids, at)
        return True

    def _uncache(self, block: int) -> None:
        block_hash = self.block_hash[block]
        self.block_hash[block] = None
        del self.cached[block_hash]
        under = self._origin[block][0]
        self._origin[block] = None
        siblings = self._children[under]
        del siblings[block]
        if not siblings:
            del self._children[under]
        self._emit(BlockRemoved(block_hash, block))

    def partial_hit(self, parent_hash: int, adapter_id: int, tokens: list[int],
                    candidates: int = 32) -> tuple[int, int]:
        """(block, k): a cached block under parent_hash (NO_PARENT: a first block) and adapter whose first
        k tokens equal tokens[:k], k the longest found among the `candidates` most recently cached such
        blocks; (-1, 0) if none shares a token. tokens: at most BLOCK_SIZE."""
        if not self.enable_prefix_caching or not tokens:
            return -1, 0
        best, best_k = -1, 0
        siblings = self._children.get((parent_hash, adapter_id), {})
        for block in islice(reversed(siblings), candidates):
            _, src, at = self._origin[block]
            k = 0
            for a, b in zip(tokens, src[at:at + len(tokens)]):
                if a != b:
                    break
                k += 1
            if k > best_k:
                best, best_k = block, k
                if k == len(tokens):
                    break
        return best, best_k

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block; returns how many."""
        n = len(self._lru)
        while self._lru:
            block, _ = self._lru.popitem(last=False)
            self._uncache(block)
            self._free.append(block)
        return n

    # -- checking ------------------------------------------------------------------------
    def check_invariants(self, idle: bool = False) -> None:
        """Raise AssertionError on any inconsistency. idle: nothing runs, so every block must
        be free or cached and every refcount zero."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & lru, f"blocks both free and cached: {sorted(free & lru)}"
        for block in range(self.num_blocks):
            ref, h = self.ref_counts[block], self.block_hash[block]
            assert ref >= 0, f"block {block}: negative refcount {ref}"
            if ref > 0:
                assert block not in free and block not in lru, f"block {block}: in use and free"
            elif h is None:
                assert block in free, f"block {block}: refcount 0, no hash, not in the free list"
            else:
                assert block in lru, f"block {block}: refcount 0, hashed, not in the LRU"
            if h is not None:
                assert self.cached.get(h) == block, f"block {block}: hash not mapped back to it"
            if idle:
                assert ref == 0, f"block {block}: refcount {ref} while idle"
        assert len(self.cached) == sum(h is not None for h in self.block_hash), "stale hash map"
        indexed = {b: under for under, blocks in self._children.items() for b in blocks}
        assert indexed == {b: o[0] for b, o in enumerate(self._origin) if o is not None}, "stale partial-hit index"
        assert set(indexed) == set(self.cached.values()), "partial-hit index and hash map disagree"
