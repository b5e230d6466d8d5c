"""Block manager: refcounts, the prefix-cache hash chain, LRU eviction, KV events, invariants."""
import pytest

from memory.block_manager import BlockManager, BlockRemoved, BlockStored, NoFreeBlocks
from memory.prefix_hash import NO_PARENT, hash_block, hash_chain

B = 16


def cache_seq(bm, blocks, tokens, adapter=0):
    """Register each full block of tokens (held in blocks) as the scheduler does."""
    parent = NO_PARENT
    for b, h in enumerate(hash_chain(tokens, B, adapter)):
        bm.cache_block(blocks[b], h, parent, tokens[b * B:(b + 1) * B], adapter)
        parent = h


def test_hash_chain_depends_on_parent_tokens_and_adapter():
    toks = list(range(48))
    chain = hash_chain(toks, B)
    assert len(chain) == 3 and len(set(chain)) == 3
    assert hash_chain(toks + [1, 2], B) == chain                     # partial block: no hash
    assert hash_chain(toks, B, adapter_id=1)[0] != chain[0]
    changed = [999] + toks[1:]
    assert all(a != b for a, b in zip(hash_chain(changed, B), chain))  # a change flows down the chain
    assert chain[1] == hash_block(chain[0], toks[16:32])
    assert hash_block(NO_PARENT, toks[16:32]) != chain[1]


def test_allocate_free_refcounts():
    bm = BlockManager(4, enable_prefix_caching=False)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)
    bm.fork(a[:2])
    bm.free(a)
    assert bm.num_free_blocks == 2                # a[0], a[1] still held by the fork
    bm.check_invariants()
    with pytest.raises(AssertionError):
        bm.check_invariants(idle=True)
    bm.free(a[:2])
    bm.check_invariants(idle=True)
    with pytest.raises(ValueError, match="double free"):
        bm.free([a[0]])


def test_prefix_hit_shares_blocks_and_events():
    bm = BlockManager(8)
    events = []
    bm.subscribe(events.append)
    toks = list(range(40))
    blocks = bm.allocate(3)
    cache_seq(bm, blocks, toks)
    chain = hash_chain(toks, B)
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert [e.block_hash for e in events] == chain
    assert events[1].parent_hash == chain[0] and events[1].token_ids == tuple(toks[16:32])
    # a second sequence with the same first 32 tokens finds both blocks while they are in use
    hit = bm.lookup(hash_chain(toks[:35], B))
    assert hit == blocks[:2]
    bm.acquire(hit)
    assert bm.ref_counts[blocks[0]] == 2
    bm.free(blocks)
    bm.free(hit)
    bm.check_invariants(idle=True)
    assert bm.num_free_blocks == 8
    # cached blocks survive freeing, and are found again
    assert bm.lookup(chain) == blocks[:2]
    assert bm.lookup(hash_chain(toks, B, adapter_id=3)) == []


def test_lru_evicts_least_recent_and_tail_first():
    bm = BlockManager(4)
    events = []
    bm.subscribe(events.append)
    s1, s2 = list(range(32)), list(range(100, 132))
    b1 = bm.allocate(2)
    cache_seq(bm, b1, s1)
    bm.free(b1)
    b2 = bm.allocate(2)                           # takes the 2 never-cached free blocks first
    assert set(b2).isdisjoint(b1)
    cache_seq(bm, b2, s2)
    bm.free(b2)
    events.clear()
    x = bm.allocate(1)                            # evicts s1's tail block (freed first-in-line)
    assert x == [b1[1]] and events == [BlockRemoved(hash_chain(s1, B)[1], b1[1])]
    assert bm.lookup(hash_chain(s1, B)) == [b1[0]]
    bm.acquire(bm.lookup(hash_chain(s2, B)))      # touching s2 protects it from eviction
    y = bm.allocate(1)
    assert y == [b1[0]]
    bm.free(x + y)
    bm.free(b2)
    bm.check_invariants(idle=True)


def test_duplicate_content_keeps_first_block():
    bm = BlockManager(4)
    toks = list(range(16))
    a, b = bm.allocate(1), bm.allocate(1)
    cache_seq(bm, a, toks)
    cache_seq(bm, b, toks)
    assert bm.lookup(hash_chain(toks, B)) == a
    bm.free(a + b)
    bm.check_invariants(idle=True)
    assert bm.num_free_blocks == 4


def test_invariant_checker_catches_corruption():
    bm = BlockManager(4)
    a = bm.allocate(2)
    bm.ref_counts[a[0]] = 0                       # leaked: refcount 0 but in no list
    with pytest.raises(AssertionError, match="not in the free list"):
        bm.check_invariants()


def test_disabled_cache_never_hits():
    bm = BlockManager(4, enable_prefix_caching=False)
    toks = list(range(32))
    blocks = bm.allocate(2)
    cache_seq(bm, blocks, toks)
    bm.free(blocks)
    assert bm.lookup(hash_chain(toks, B)) == []
    bm.check_invariants(idle=True)


def test_reset_prefix_cache():
    bm = BlockManager(4)
    removed = []
    bm.subscribe(lambda e: removed.append(e) if isinstance(e, BlockRemoved) else None)
    blocks = bm.allocate(2)
    cache_seq(bm, blocks, list(range(32)))
    bm.free(blocks)
    assert bm.reset_prefix_cache() == 2 and len(removed) == 2
    assert bm.cached == {}
    bm.check_invariants(idle=True)


def test_subscribers_without_stored_get_only_removals():
    bm = BlockManager(4)
    everything, removals = [], []
    bm.subscribe(removals.append, stored=False)
    blocks = bm.allocate(2)
    cache_seq(bm, blocks, list(range(32)))
    assert removals == []                                  # no BlockStored built for it
    bm.subscribe(everything.append)
    more = bm.allocate(1)
    cache_seq(bm, more, list(range(100, 116)))
    assert [type(e) for e in everything] == [BlockStored] and removals == []
    bm.free(blocks + more)
    assert bm.reset_prefix_cache() == 3
    assert [type(e) for e in removals] == [BlockRemoved] * 3
    assert [type(e) for e in everything] == [BlockStored] + [BlockRemoved] * 3


def test_cache_blocks_equals_cache_block_one_by_one():
    """The one-pass registration (a host-tier restore) leaves the same cache and emits the same events as
    cache_block per block, skipping blocks or hashes already cached."""
    tokens = list(range(5 * B + 3))
    chain = hash_chain(tokens, B, 3)
    states = []
    for batched in (False, True):
        bm = BlockManager(12)
        events = []
        bm.subscribe(events.append)
        pre = bm.allocate(1)
        bm.cache_block(pre[0], chain[1], chain[0], tokens[B:2 * B], 3)       # block 1's hash cached elsewhere
        blocks = bm.allocate(4)
        if batched:
            bm.cache_blocks(blocks, chain, 1, tokens, 3)
        else:
            for k, block in enumerate(blocks):
                i = 1 + k
                bm.cache_block(block, chain[i], chain[i - 1], tokens[i * B:(i + 1) * B], 3)
        states.append((dict(bm.cached), list(bm.block_hash), events))
    assert states[0] == states[1]
    assert len(states[1][2]) == 4                          # the pre-cached hash is not stored twice


def test_recent_chains_reuse_exactly_the_shared_full_blocks():
    """RecentChains hands back the hashes of the leading full blocks a new prompt shares token for token with a
    remembered one of the same adapter (the chain a fresh hash_chain gives), nothing across adapters or for a
    different first block, and forgets the least recently used beyond its capacity."""
    import numpy as np

    from memory.prefix_hash import RecentChains
    rc = RecentChains(B, capacity=2)
    a = np.arange(100, 170, dtype=np.int32)                       # 4 full blocks + 6 tokens
    rc.remember(a, 0, hash_chain(a.tolist(), B))
    assert rc.reuse(a) == hash_chain(a.tolist(), B)
    b = a.copy()
    b[40] = 7                                                     # differs inside block 2
    assert rc.reuse(b) == hash_chain(a.tolist(), B)[:2] == hash_chain(b.tolist(), B)[:2]
    assert rc.reuse(a[:20]) == hash_chain(a.tolist(), B)[:1]      # a shorter prompt: its own full blocks
    assert rc.reuse(a, adapter_id=3) == [] and rc.reuse(a + 1) == []
    rc.remember(a, 0, hash_chain(a.tolist(), B) + [123])          # hashes past the tokens are not kept
    assert rc.reuse(np.concatenate([a, a])) == hash_chain(a.tolist(), B)
    rc.remember(a + 1, 0, hash_chain((a + 1).tolist(), B))
    rc.remember(a + 2, 0, hash_chain((a + 2).tolist(), B))        # capacity 2: a goes
    assert rc.reuse(a) == [] and rc.reuse(a + 2) == hash_chain((a + 2).tolist(), B)


def test_partial_hit_longest_shared_start_under_the_same_parent_and_adapter():
    bm = BlockManager(8)
    toks = list(range(100, 132))
    blocks = bm.allocate(2)
    cache_seq(bm, blocks, toks)
    chain = hash_chain(toks, B)
    other = bm.allocate(1)                                    # a sibling of block 1 sharing its first 5 tokens
    sibling = toks[16:21] + [7] * 11
    bm.cache_block(other[0], hash_block(chain[0], sibling), chain[0], sibling)
    assert bm.partial_hit(chain[0], 0, toks[16:31]) == (blocks[1], 15)
    assert bm.partial_hit(chain[0], 0, toks[16:21] + [7, 7, 9]) == (other[0], 7)
    assert bm.partial_hit(chain[0], 0, [5, 6]) == (-1, 0)
    assert bm.partial_hit(NO_PARENT, 0, toks[:3]) == (blocks[0], 3)
    assert bm.partial_hit(NO_PARENT, 1, toks[:3]) == (-1, 0)          # another adapter's block: never
    assert bm.partial_hit(chain[1], 0, toks[16:20]) == (-1, 0)        # another parent: never
    bm.check_invariants()
    bm.free(blocks + other)
    bm.reset_prefix_cache()                                   # evicted: gone from the index too
    assert bm.partial_hit(NO_PARENT, 0, toks[:3]) == (-1, 0)
    bm.check_invariants(idle=True)
    off = BlockManager(4, enable_prefix_caching=False)
    assert off.partial_hit(NO_PARENT, 0, [1]) == (-1, 0)
