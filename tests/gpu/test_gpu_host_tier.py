"""The host KV tier on the GPU executor (memory/host_kv_copy.py).

CPU: the copy plan (runs of consecutive pairs, pitches, the per-plane fallback past the pitch limit,
argument checks) driven through a memmove-based memcpy2d over numpy arrays, against a per-block
numpy reference. GPU: a direct round trip through pinned slots (random KV -> offload -> overwrite
the device blocks -> restore into other blocks -> bytes equal), and the engine on a tiny random Qwen3
with a KV pool too small to keep a prompt's prefix: the prefix comes back from the tier (stats show
the restored blocks), its KV bytes equal the ones first computed, and greedy decoding after the
restore generates exactly what it generated after a device prefix-cache hit."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.batch import BLOCK_SIZE
from memory.host_kv_copy import HostKVCopy, Run, copy_runs

SHAPE = (3, 2, 12 * BLOCK_SIZE, 2, 8)          # 3 layers, 12 blocks, 2 KV heads, head_dim 8
SLOTS = 7


def memmove_2d(calls: list):
    """A host stand-in for cudaMemcpy2DAsync over raw addresses; records (width, height, to_host)."""
    def copy(dst, dpitch, src, spitch, width, height, to_host):
        assert width <= dpitch and width <= spitch
        calls.append((width, height, to_host))
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
    return copy


def blocks_of(a: np.ndarray, ids) -> np.ndarray:
    """[n, L, 2, 16, Hkv, D]: the 16 rows of each id in every layer and plane."""
    return np.stack([a[:, :, i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] for i in ids])


def reference_copy(kv: np.ndarray, host: np.ndarray, offloads, restores) -> None:
    for b, s in offloads:
        host[:, :, s * BLOCK_SIZE:(s + 1) * BLOCK_SIZE] = kv[:, :, b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]
    for s, b in restores:
        kv[:, :, b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE] = host[:, :, s * BLOCK_SIZE:(s + 1) * BLOCK_SIZE]


def host_slots(shape=SHAPE, slots=SLOTS, dtype=np.uint16) -> np.ndarray:
    return np.zeros(shape[:2] + (slots * BLOCK_SIZE,) + shape[3:], dtype)


def test_runs_merge_consecutive_pairs_in_order():
    pairs = [(3, 0), (4, 1), (5, 2), (9, 3), (1, 4), (2, 6), (3, 7), (3, 5)]
    assert copy_runs(pairs, 12, 8, "offload", "device block", "host slot") == [
        Run(3, 0, 3), Run(9, 3, 1), Run(1, 4, 1), Run(2, 6, 2), Run(3, 5, 1)]
    assert copy_runs([], 12, 8, "offload", "device block", "host slot") == []


@pytest.mark.parametrize("max_pitch", [1 << 31, 1000])       # 2D copies; one copy per plane
def test_copy_blocks_moves_the_same_bytes_as_the_reference(max_pitch):
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 1 << 16, SHAPE, dtype=np.uint16)
    host = host_slots()
    calls: list = []
    copier = HostKVCopy(kv.ctypes.data, kv.shape, kv.dtype, host, memmove_2d(calls), max_pitch=max_pitch)
    assert copier.num_blocks == 12 and copier.num_slots == SLOTS and copier.planes == 6
    assert copier.chunk == BLOCK_SIZE * 2 * 8 * 2 and copier.block_bytes == 6 * copier.chunk
    want_kv, want_host = kv.copy(), host.copy()
    offloads = [(2, 0), (3, 1), (4, 2), (10, 5), (7, 6)]
    restores = [(5, 11), (0, 3), (1, 4), (6, 0)]               # (6, 0): a slot written this same step
    kv_before = kv.copy()
    n = copier.copy_blocks(offloads, restores)
    reference_copy(want_kv, want_host, offloads, restores)
    np.testing.assert_array_equal(host, want_host)
    np.testing.assert_array_equal(kv, want_kv)
    np.testing.assert_array_equal(blocks_of(kv, [3, 4, 11, 0]), blocks_of(kv_before, [2, 3, 10, 7]))
    runs = 6                                                   # 3 offload runs, 3 restore runs
    per_run = 1 if max_pitch > 12 * copier.chunk else copier.planes
    assert n == len(calls) == runs * per_run
    assert [c[2] for c in calls] == [True] * (3 * per_run) + [False] * (3 * per_run)   # offloads first
    if per_run == 1:
        assert calls[0] == (3 * copier.chunk, copier.planes, True)


@pytest.mark.parametrize("max_pitch", [1 << 31, 1000])
def test_restore_layers_copies_layer_by_layer(max_pitch):
    """restore_layers moves the bytes copy_blocks' restores move, one layer at a time: when layer l is
    reported done, layers 0..l of every destination block hold their slots and later layers do not yet."""
    rng = np.random.default_rng(1)
    kv = rng.integers(0, 1 << 16, SHAPE, dtype=np.uint16)
    host = rng.integers(0, 1 << 16, host_slots().shape, dtype=np.uint16)
    calls: list = []
    copier = HostKVCopy(kv.ctypes.data, kv.shape, kv.dtype, host, memmove_2d(calls), max_pitch=max_pitch)
    restores = [(5, 11), (0, 3), (1, 4), (6, 0)]
    want = kv.copy()
    reference_copy(want, host.copy(), [], restores)
    before, done = kv.copy(), []

    def layer_done(layer: int) -> None:
        dst = [b for _, b in restores]
        assert (blocks_of(kv, dst)[:, :layer + 1] == blocks_of(want, dst)[:, :layer + 1]).all()
        assert (blocks_of(kv, dst)[:, layer + 1:] == blocks_of(before, dst)[:, layer + 1:]).all()
        done.append(layer)

    n = copier.restore_layers(restores, layer_done)
    np.testing.assert_array_equal(kv, want)
    assert done == list(range(SHAPE[0])) and n == len(calls)
    assert all(not to_host for _, _, to_host in calls)

def test_bad_pairs_are_named_and_nothing_is_copied():
    kv = np.ones(SHAPE, np.uint16)
    calls: list = []
    copier = HostKVCopy(kv.ctypes.data, kv.shape, kv.dtype, host_slots(), memmove_2d(calls))
    with pytest.raises(ValueError, match="device block 12 is outside 0..11"):
        copier.copy_blocks([(12, 0)], [])
    with pytest.raises(ValueError, match="host slot 7 is outside 0..6"):
        copier.copy_blocks([(0, 1)], [(7, 2)])                 # the good offload is not issued either
    with pytest.raises(ValueError, match=r"restore: want \(host slot, device block\) pairs"):
        copier.copy_blocks([], [(1, 2, 3)])
    with pytest.raises(ValueError, match="device block -1"):
        copier.copy_blocks([(-1, 0)], [])
    assert calls == []


def test_layout_mismatches_are_refused():
    kv = np.ones(SHAPE, np.uint16)
    copy = memmove_2d([])
    with pytest.raises(ValueError, match="KV pool shape"):
        HostKVCopy(kv.ctypes.data, (3, 12 * BLOCK_SIZE, 2, 8), kv.dtype, host_slots(), copy)
    with pytest.raises(ValueError, match="host KV slots"):
        HostKVCopy(kv.ctypes.data, kv.shape, kv.dtype, host_slots(dtype=np.float32), copy)
    with pytest.raises(ValueError, match="host KV slots"):
        HostKVCopy(kv.ctypes.data, kv.shape, kv.dtype, host_slots(shape=(3, 2, 16, 4, 8)), copy)


# ---- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("max_pitch", [None, 4096])
def test_gpu_round_trip_through_pinned_slots(max_pitch):
    import cupy

    from memory.host_kv_copy import gpu_host_kv_copy
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    shape = (4, 2, 64 * BLOCK_SIZE, 2, 32)
    start = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    kv = cupy.asarray(start)
    cupy.cuda.Device().synchronize()                           # the upload ran on the default stream
    copier = gpu_host_kv_copy(kv, 16, stream)
    if max_pitch is not None:
        copier.max_pitch = max_pitch                           # the one-copy-per-plane path
    offloads = [(5, 0), (6, 1), (7, 2), (40, 9), (13, 15)]
    n = copier.copy_blocks(offloads, [])
    with stream:
        kv[:] = cupy.asarray(rng.integers(0, 1 << 16, shape, dtype=np.uint16))   # overwrite every block
    restores = [(0, 60), (1, 61), (2, 62), (9, 3), (15, 40)]
    n += copier.copy_blocks([], restores)
    stream.synchronize()
    assert n == (6 if max_pitch is None else 6 * copier.planes)
    np.testing.assert_array_equal(blocks_of(copier.host, [0, 1, 2, 9, 15]), blocks_of(start, [5, 6, 7, 40, 13]))
    np.testing.assert_array_equal(blocks_of(kv.get(), [60, 61, 62, 3, 40]), blocks_of(start, [5, 6, 7, 40, 13]))


@pytest.mark.gpu
@pytest.mark.parametrize("async_copies", [False, True])
def test_gpu_engine_prefix_comes_back_from_the_host_tier(async_copies):
    """Also with async copies (restores and write-throughs on their own stream, the request LOADING
    until they land, blocks held until written through)."""
    from fake_executor import make_engine, run_until_idle, submit
    from test_host_tier import cached, tokens

    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from engine.request import GenerateRequest, SamplingParams
    from memory.prefix_hash import hash_chain
    from harness.models import tiny_model_path

    model = load_model(tiny_model_path("qwen3_gqa4"))
    ex = GpuExecutor(model, options_of(num_kv_blocks=10, max_model_len=512, max_num_batched_tokens=512,
                                       max_num_seqs=16, progress=False, host_kv_blocks=32,
                                       async_host_tier=async_copies))
    engine = make_engine(ex, model.tokenizer, max_model_len=512, host_kv_blocks=32, max_num_seqs=16,
                         max_num_batched_tokens=512)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(70)]
    hashes = hash_chain(prompt[:64], BLOCK_SIZE)

    def run(rid, ids):
        events = submit(engine, GenerateRequest(rid, ids, params))
        run_until_idle(engine)
        return events

    def prefix_kv():
        blocks = engine.block_manager.lookup(hashes)
        assert len(blocks) == 4
        return blocks_of(ex.kv_cache.get(), blocks)

    try:
        first = run("a1", prompt)
        hit = run("a2", prompt)                                # device prefix-cache hit
        kv_first = prefix_kv()
        for i in range(4):
            run(f"o{i}", [200 + i] + list(range(1, 70)))
        assert engine.block_manager.lookup(hashes) == []       # the device pool lost the prefix
        again = run("a3", prompt)
        assert engine.scheduler.host_tier.async_copies is async_copies and not engine.scheduler.loading
        while (ticket := engine.scheduler.host_tier.oldest_ticket()) is not None:     # write-throughs still in flight
            ex.wait_copies(ticket)
            engine.scheduler.land_copies()
        engine.block_manager.check_invariants(idle=True)
        stats = engine.stats()
        assert cached(hit) == cached(again) == 64
        assert stats.host_kv_restored_blocks == 4 and stats.host_kv_stored_blocks >= 4
        np.testing.assert_array_equal(prefix_kv(), kv_first)   # restored bytes == the computed ones
        assert tokens(again) == tokens(hit) and len(tokens(again)) == 8
        print("first", tokens(first), "hit", tokens(hit), "restored", tokens(again))
    finally:
        ex.close()


@pytest.mark.gpu
@pytest.mark.parametrize("async_copies", [False, True])
def test_gpu_restored_prefix_scores_as_the_cold_prefill(async_copies):
    """The issue's 'nothing lost' gate: a prompt prefilled cold, its prefix blocks offloaded to the host slots,
    the device blocks overwritten by another prompt (the pool reused), the prefix restored into other blocks
    and the prompt's tail computed over it: the tail's logits score as the cold prefill's own rows did, by the
    gate of the prefix-hit tests (bf16 rounding apart: the tail runs as a chunk over the cache)."""
    from engine.batch import ModelBatch, SeqStep
    from engine.loader import load_model
    from harness.executors import new_gpu_executor
    from harness.models import random_sequences, tiny_model_path
    from test_gpu_moe_mla import assert_same_scores

    model = load_model(tiny_model_path("qwen3_gqa4"))
    ex = new_gpu_executor(model, cuda_graphs=False, host_kv_blocks=8, async_host_tier=async_copies)
    try:
        vocab = model.config.vocab_size
        seq, other = random_sequences(vocab, [70, 80], seed=3)
        cold = ex.forward_logits(ModelBatch.build([SeqStep(0, seq, 0, [0, 1, 2, 3, 4], False)]))
        ex.wait_copies(ex.copy_blocks([(0, 0), (1, 1), (2, 2), (3, 3)], []))
        before = blocks_of(ex.kv_cache.get(), [0, 1, 2, 3])
        ex.forward_logits(ModelBatch.build([SeqStep(1, other, 0, [0, 1, 2, 3, 4], False)]))   # pool reused
        ex.wait_copies(ex.copy_blocks([], [(0, 10), (1, 11), (2, 12), (3, 13)]))
        np.testing.assert_array_equal(blocks_of(ex.kv_cache.get(), [10, 11, 12, 13]), before)   # byte-exact back
        hit = ex.forward_logits(ModelBatch.build([SeqStep(2, seq[64:], 64, [10, 11, 12, 13, 14], False)]))
        assert_same_scores(hit, cold[64:])
    finally:
        ex.close()
