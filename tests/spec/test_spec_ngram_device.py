"""The GPU executor's n-gram proposer (engine/executor/gpu_ngram.py) with its kernels run by the host emulation
(tests/cuda_emulation.h) and its device arrays in host memory: over simulated engine steps (verify steps with
random acceptance laid out as spec_accept.cu does, plain decode steps, prefills admitting sequences, sequences
finishing, skipped steps, steps sampled on the host side that the device never sees, ids the host cuts, more
sequences than rows) its drafts equal the host NgramProposer's (vLLM's prompt lookup) on the host's ids, every
step; and a steady decode proposes from the steps' read-backs alone (no wait on the device)."""
from __future__ import annotations

import random

import numpy as np
from test_decode_kernels_emulated import run
from test_deltanet_kernels_emulated import host

from engine.batch import SeqStep
from engine.executor.gpu_ngram import GpuNgramProposer
from engine.ngram import NgramProposer
from engine.request import SamplingParams
from engine.sequence import Sequence
from engine.speculative import SpeculativeConfig


class Staging:
    def __init__(self, words: int):
        self.buffer = np.zeros(words, np.int32)

    def take(self) -> np.ndarray:
        return self.buffer

    def sent(self, stream) -> None:
        pass


class EmulatedDevice:
    """CupyDevice's surface over host memory, kernels through the emulation (ngram_draft with blocks of one
    warp: a few OS threads a block; tests/kernels/test_ngram_draft_emulated.py runs the GPU's 256); counts the
    waits (round trips)."""
    stream = None

    def __init__(self):
        self.waits = 0

    def zeros(self, shape):
        return host(np.zeros(shape, np.int32))

    def pinned(self, words: int) -> np.ndarray:
        return np.zeros(words, np.int32)

    def staging(self, words: int) -> Staging:
        return Staging(words)

    def write(self, dst, values) -> None:
        dst[...] = values

    def launch(self, entry, grid, block, args) -> None:
        run("ngram_draft", entry, (grid,), 32, args, NGRAM_THREADS=32)

    def copy(self, pairs, to_host: bool) -> None:
        for h, d, words in pairs:
            if to_host:
                h[:words] = d.reshape(-1)[:words]
            else:
                d.reshape(-1)[:words] = h[:words]

    def wait(self) -> None:
        self.waits += 1


def new_seq(seq_id: int, rng: random.Random, alphabet: int) -> Sequence:
    prompt = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))]
    return Sequence(seq_id, f"r{seq_id}", prompt, len(prompt), SamplingParams(max_tokens=1000))


def verify_step(seqs: list[Sequence], drafts: list[list[int]], rng: random.Random, alphabet: int):
    """A verify step's SeqSteps and spec_accept.cu's output (ids by row, row starts, accepted counts), each
    sequence accepting a random prefix of its drafts; the ids each emits."""
    steps, ids, starts, accepted, emitted = [], [], [0], [], []
    for seq, d in zip(seqs, drafts):
        L = len(seq.token_ids)
        steps.append(SeqStep(seq_id=seq.seq_id, token_ids=[seq.token_ids[-1]] + d, start_pos=L - 1, block_table=[],
                             sample=True, num_drafts=len(d)))
        a = rng.randrange(len(d) + 1)
        rows = d[:a] + [rng.randrange(alphabet)] + [rng.randrange(alphabet) for _ in range(len(d) - a)]
        ids += rows
        starts.append(len(ids))
        accepted.append(a)
        emitted.append(rows[:a + 1])
    return steps, np.array(ids, np.int32), np.array(starts, np.int32), np.array(accepted, np.int32), emitted


def prefill_step(seq: Sequence) -> SeqStep:
    return SeqStep(seq_id=seq.seq_id, token_ids=list(seq.token_ids), start_pos=0, block_table=[], sample=True)


def simulate(seed: int, rows: int, steps: int, device=None, to_device=host, landed=lambda: None) -> None:
    """Random engine steps over a proposer on `device` (EmulatedDevice by default; tests/gpu/test_gpu_ngram.py
    runs it on the GPU: `to_device` puts a step's ids there, `landed` waits for the step's read-back)."""
    rng = random.Random(seed)
    alphabet, k = rng.choice([3, 5, 8]), rng.randrange(1, 6)
    min_n = rng.randrange(1, 4)
    config = SpeculativeConfig("ngram", k, min_n, rng.randrange(min_n, 5))
    proposer = GpuNgramProposer(device or EmulatedDevice(), config, rows, 200)
    oracle = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    running, next_id = [], 0
    for step in range(steps):
        if len(running) < 6 and rng.random() < 0.3:           # a prefill step admits one
            seq, next_id = new_seq(next_id, rng, alphabet), next_id + 1
            token = rng.randrange(alphabet)
            proposer.tap([prefill_step(seq)], to_device(np.array([token], np.int32)))
            landed()
            seq.token_ids.append(token)
            running.append(seq)
            continue
        if not running:
            continue
        proposer.keep({s.seq_id for s in running})
        decoding = [s for s in running if rng.random() < 0.7]
        # in the step without a proposal (its limit 0: no room, k 0 at this batch size, a fork), or sitting it out
        bystanders = [s for s in running if s not in decoding and rng.random() < 0.5]
        limits = [rng.randrange(1, k + 1) for _ in decoding]
        drafts = proposer.propose(decoding, limits)
        assert drafts == oracle.propose(decoding, limits), (seed, step)
        stepped, drafts = decoding + bystanders, drafts + [[] for _ in bystanders]
        if not stepped:
            continue
        on_host = rng.random() < 0.15                         # sampled on the host side: GpuExecutor.submit's tap
        if any(drafts):
            steps_, ids, starts, accepted, emitted = verify_step(stepped, drafts, rng, alphabet)
            tap = (steps_, to_device(ids), to_device(starts), to_device(accepted))
        else:
            steps_ = [SeqStep(seq_id=s.seq_id, token_ids=[s.token_ids[-1]], start_pos=len(s.token_ids) - 1,
                              block_table=[], sample=True) for s in stepped]
            emitted = [[rng.randrange(alphabet)] for _ in stepped]
            tap = (steps_, to_device(np.array([e[0] for e in emitted], np.int32)))
        proposer.tap(*(([], None) if on_host else tap))
        landed()
        for seq, ids_ in zip(stepped, emitted):
            cut = rng.random() < 0.05 and len(ids_) > 1          # the host keeps fewer ids than the device wrote
            seq.token_ids.extend(ids_[:-1] if cut else ids_)
        if rng.random() < 0.1:                                # one finishes
            running.remove(rng.choice(running))
        if any(len(s.token_ids) > 180 for s in running):
            running = [s for s in running if len(s.token_ids) <= 180]


def test_device_drafts_equal_the_host_lookup_over_engine_steps():
    for seed in range(6):
        simulate(seed, rows=8, steps=40)


def test_a_sequence_without_a_free_row_is_drafted_on_the_host():
    """Rows still held by sequences not yet dropped (keep() not called since): the newcomer's drafts come from
    the host's lookup, the same drafts."""
    rng = random.Random(2)
    device = EmulatedDevice()
    proposer = GpuNgramProposer(device, SpeculativeConfig("ngram", 3, 1, 2), 2, 100)
    seqs = [Sequence(i, f"r{i}", [rng.randrange(3) for _ in range(20)], 20, SamplingParams()) for i in range(3)]
    oracle = NgramProposer(1, 2)
    assert proposer.propose(seqs[:2], [3, 3]) == oracle.propose(seqs[:2], [3, 3])
    assert proposer.propose(seqs[1:], [2, 3]) == oracle.propose(seqs[1:], [2, 3])
    assert seqs[2].seq_id not in proposer.rows


def test_a_steady_decode_waits_on_nothing_to_propose():
    """Two sequences decoding every step, nothing admitted or cut: after their first proposals (the upload and
    one wait) every draft comes from the step before's read-back."""
    rng = random.Random(5)
    config = SpeculativeConfig("ngram", 3, 1, 3)
    device = EmulatedDevice()
    proposer = GpuNgramProposer(device, config, 4, 300)
    oracle = NgramProposer(1, 3)
    seqs = [Sequence(i, f"r{i}", [rng.randrange(4) for _ in range(30)], 30, SamplingParams()) for i in range(2)]
    for step in range(25):
        drafts = proposer.propose(seqs, [3, 2])
        assert drafts == oracle.propose(seqs, [3, 2])
        assert device.waits == 1, step
        if any(drafts):
            steps_, ids, starts, accepted, emitted = verify_step(seqs, drafts, rng, 4)
            proposer.tap(steps_, host(ids), host(starts), host(accepted))
        else:
            emitted = [[rng.randrange(4)] for _ in seqs]
            proposer.tap([SeqStep(seq_id=s.seq_id, token_ids=[s.token_ids[-1]], start_pos=len(s.token_ids) - 1,
                                  block_table=[], sample=True) for s in seqs],
                         host(np.array([e[0] for e in emitted], np.int32)))
        for seq, e in zip(seqs, emitted):
            seq.token_ids.extend(e)



def plain_step(seq: Sequence, fed: bool) -> SeqStep:
    """A decode step's SeqStep (fed: launched before its input id, the step before's, reached the host)."""
    return SeqStep(seq_id=seq.seq_id, token_ids=[-1 if fed else seq.token_ids[-1]],
                   start_pos=len(seq.token_ids) - (0 if fed else 1), block_table=[], sample=True)


def test_steps_launched_ahead_keep_the_rows_and_say_where_none_drafted():
    """The engine loop's overlap: while no sequence has a draft, steps go out ahead without a proposal (the step
    before's ids not yet on the host). none_drafted answers, from the last landed read-back and without a wait,
    what the host's lookup gives at the ids known then; the proposal after such a stretch needs no wait either."""
    rng = random.Random(11)
    device = EmulatedDevice()
    proposer = GpuNgramProposer(device, SpeculativeConfig("ngram", 3, 2, 3), 4, 400)
    oracle = NgramProposer(2, 3)
    seqs = [Sequence(i, f"r{i}", [rng.randrange(24) for _ in range(30)], 30, SamplingParams()) for i in range(3)]
    inflight, launched_ahead, verified, waits = None, 0, 0, None
    for step in range(90):
        if inflight is None:                         # a step scheduled after the last one's ids: proposed
            drafts = proposer.propose(seqs, [3, 3, 3])
            waits = device.waits if waits is None else waits          # (the first proposal uploads the rows)
            assert drafts == oracle.propose(seqs, [3, 3, 3]) and device.waits == waits, step
            if any(drafts):
                steps_, ids, starts, accepted, emitted = verify_step(seqs, drafts, rng, 24)
                proposer.tap(steps_, host(ids), host(starts), host(accepted))
                for seq, e in zip(seqs, emitted):
                    seq.token_ids.extend(e)
                verified += 1
                continue
            inflight = [rng.randrange(24) for _ in seqs]
            proposer.tap([plain_step(s, False) for s in seqs], host(np.array(inflight, np.int32)))
        none = proposer.none_drafted(seqs)            # while `inflight` runs: may the next step go ahead?
        drafted = any(oracle.propose(seqs, [3, 3, 3]))
        assert not (none and drafted) and (none or drafted or step == 0), step   # (step 0: proposed on demand)
        ahead = None
        if none and rng.random() < 0.9:
            ahead = [rng.randrange(24) for _ in seqs]
            proposer.tap([plain_step(s, True) for s in seqs], host(np.array(ahead, np.int32)))
            launched_ahead += 1
        for seq, t in zip(seqs, inflight):            # the step's ids reach the host
            seq.token_ids.append(t)
        inflight = ahead
    assert launched_ahead > 20 and verified > 5 and device.waits == waits
