"""ModelBatch.build (vectorized) against a per-sequence reference written from the contract in
engine/batch.py's docstring, on random mixes of prefill chunks and decodes."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep


def reference_build(seqs: list[SeqStep]) -> dict[str, np.ndarray]:
    """The definition, one token at a time."""
    ids, pos, slots, cu, ctx, rows = [], [], [], [0], [], []
    width = max([len(s.block_table) for s in seqs] + [1])
    tables = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        for k, t in enumerate(s.token_ids):
            p = s.start_pos + k
            ids.append(t)
            pos.append(p)
            slots.append(s.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        cu.append(cu[-1] + len(s.token_ids))
        ctx.append(s.start_pos + len(s.token_ids))
        tables[i, :len(s.block_table)] = s.block_table
        if s.sample:
            rows.append(cu[-1] - 1)
    as32 = lambda x: np.asarray(x, dtype=np.int32)
    return dict(input_ids=as32(ids), positions=as32(pos), slot_mapping=as32(slots),
                cu_seqlens=as32(cu), context_lens=as32(ctx), block_tables=tables,
                sample_rows=as32(rows))


def random_step(rng: random.Random, seq_id: int, kind: str, num_blocks: int) -> SeqStep:
    start = rng.randint(0, 3000)
    n = 1 if kind == "decode" else rng.randint(1, 700)
    need = -(-(start + n) // BLOCK_SIZE)
    table = rng.sample(range(num_blocks), need + rng.randint(0, 3))   # may hold spare blocks
    sample = kind == "decode" or rng.random() < 0.5                  # a last chunk samples
    tokens = [rng.randrange(152_000) for _ in range(n)]
    return SeqStep(seq_id, tokens, start, table, sample)


@pytest.mark.parametrize("seed", range(40))
def test_build_equals_reference_on_random_mixes(seed):
    rng = random.Random(seed)
    mix = rng.choice(["decode", "prefill", "mixed"])
    steps = [random_step(rng, i, rng.choice(["decode", "prefill"]) if mix == "mixed" else mix, 20_000)
             for i in range(rng.randint(1, 80))]
    got, want = ModelBatch.build(steps), reference_build(steps)
    assert got.seqs is steps
    for name, ref in want.items():
        arr = getattr(got, name)
        assert arr.dtype == np.int32, name
        np.testing.assert_array_equal(arr, ref, err_msg=name)
    assert got.num_tokens == sum(len(s.token_ids) for s in steps)
    assert got.is_decode_only == all(len(s.token_ids) == 1 for s in steps)


def test_build_of_a_large_decode_batch():
    rng = random.Random(7)
    steps = [random_step(rng, i, "decode", 100_000) for i in range(256)]
    got, want = ModelBatch.build(steps), reference_build(steps)
    for name, ref in want.items():
        np.testing.assert_array_equal(getattr(got, name), ref, err_msg=name)


def test_build_of_no_steps_is_empty():
    b = ModelBatch.build([])
    assert b.num_tokens == 0 and b.block_tables.shape == (0, 1)
    assert b.cu_seqlens.tolist() == [0] and b.sample_rows.shape == (0,)


def test_build_rejects_an_empty_step_and_a_short_block_table_naming_the_sequence():
    ok = SeqStep(1, [5], 0, [3], True)
    with pytest.raises(ValueError, match="seq 9: empty step"):
        ModelBatch.build([ok, SeqStep(9, [], 4, [0], True)])
    with pytest.raises(ValueError, match="seq 4: block table has 1 blocks, needs 2"):
        ModelBatch.build([ok, SeqStep(4, [1, 2], 15, [0], True)])
    with pytest.raises(ValueError, match="seq 2: block table has 0 blocks, needs 1"):
        ModelBatch.build([SeqStep(2, [1], 0, [], True), SeqStep(3, [], 0, [], True)])


def test_kept_int32_tables_build_the_same_batch():
    """Steps carrying their tables as int32 arrays (the scheduler's) build the batch the lists build."""
    import dataclasses

    from engine.batch import ModelBatch, SeqStep
    rng = np.random.default_rng(3)
    for trial in range(20):
        seqs = []
        for i in range(int(rng.integers(1, 9))):
            n = 1 if rng.random() < 0.6 else int(rng.integers(2, 40))
            start = int(rng.integers(0, 300))
            table = rng.permutation(500)[: -(-(start + n) // 16) + int(rng.integers(0, 3))].tolist()
            seqs.append(SeqStep(seq_id=i, token_ids=rng.integers(0, 99, n).tolist(), start_pos=start,
                                block_table=table, sample=bool(rng.random() < 0.8)))
        plain = ModelBatch.build(seqs)
        kept = ModelBatch.build([dataclasses.replace(s, block_array=np.asarray(s.block_table, np.int32))
                                 for s in seqs])
        for f in ("input_ids", "positions", "slot_mapping", "cu_seqlens", "context_lens", "block_tables",
                  "sample_rows"):
            np.testing.assert_array_equal(getattr(kept, f), getattr(plain, f), err_msg=f"{f}, trial {trial}")
        assert kept.is_decode_only == all(len(s.token_ids) == 1 for s in seqs)


def test_sequence_table_array_follows_its_list():
    from engine.request import SamplingParams
    from engine.sequence import Sequence
    seq = Sequence(seq_id=1, request_id="r", token_ids=[1, 2, 3], prompt_len=3, params=SamplingParams(seed=5))
    assert seq.block_table_array().tolist() == []
    seq.block_table += [7, 8]                         # grows in place (allocation)
    assert seq.block_table_array().tolist() == [7, 8]
    seq.block_table += [9]
    assert seq.block_table_array().tolist() == [7, 8, 9]
    seq.block_table = [4, 5, 6]                       # replaced (preempted and re-admitted): same length
    assert seq.block_table_array().tolist() == [4, 5, 6]
    seq.block_table = []
    assert seq.block_table_array().tolist() == []
    child = seq.fork(2, 1)
    child.block_table += [11]
    assert child.block_table_array().tolist() == [11] and seq.block_table_array().tolist() == []


def test_fed_rows_are_the_leading_placeholder_rows():
    """A step queued before the one ahead of it finished (async scheduling): its leading one-token rows
    carry the placeholder -1 (ids taken on the device); admitted prompts after them carry their own."""
    def step(sid, ids, start):
        return SeqStep(seq_id=sid, token_ids=ids, start_pos=start, block_table=[sid], sample=True)

    mixed = ModelBatch.build([step(0, [-1], 5), step(1, [-1], 9), step(2, [7, 8, 9], 0)])
    assert mixed.fed_rows() == 2
    assert ModelBatch.build([step(0, [-1], 5), step(1, [-1], 3)]).fed_rows() == 2
    for bad in ([step(0, [4], 5), step(1, [-1], 9)],          # a placeholder after a row with its own id
                [step(0, [-1, -1], 5)],                      # a placeholder row of two tokens
                [step(0, [3], 5)]):                          # nothing to feed
        with pytest.raises(ValueError, match="fed step"):
            ModelBatch.build(bad).fed_rows()
