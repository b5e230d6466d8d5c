"""A line whose per-sequence state a prefix hit rebuilds by recomputing the hit's last tokens (DeepSeek-V4's
compressor rings; engine/scheduler.py _replay), through the scheduler and the engine loop with a fake model whose
state slot keeps the tokens fed to it and which needs the last replay_tokens(p) of them to go on at position p:
every step finds its slot holding those tokens, a replay starts exactly replay_tokens(hit) before the hit (or
before the fork of an n > 1 request's samples after their shared prefill), the replayed positions write no KV (slot -1: the hit's shared blocks keep what they hold), and the outputs are those
of the same requests with prefix caching off, while the cache served hits."""
from __future__ import annotations

import random

from engine.events import Token
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit


class ReplayFake(FakeExecutor):
    """FakeExecutor whose model keeps, per state slot, the tokens fed to it by position and needs the last
    hit % 5 + 5 of them to continue (an open window of 5 and the one before, as an overlapping compressor)."""

    def __init__(self, num_state_slots: int, **kw):
        super().__init__(**kw)
        self.num_state_slots = num_state_slots
        self.fed: dict[int, dict[int, int]] = {}
        self.replays = 0

    def replay_tokens(self, hit: int) -> int | None:
        return min(hit, hit % 5 + 5)

    def execute(self, batch):
        cu, slots = batch.cu_seqlens.tolist(), batch.slot_mapping
        for i, (step, slot) in enumerate(zip(batch.seqs, batch.state_slots.tolist())):
            positions = batch.positions[cu[i]:cu[i + 1]]
            assert ((slots[cu[i]:cu[i + 1]] < 0) == (positions < step.kv_from)).all(), "a replayed slot written"
            fed = {} if step.start_pos == 0 else self.fed.get(slot, {})
            replay_from = step.kv_from - self.replay_tokens(step.kv_from)
            if step.kv_from and step.start_pos == replay_from:   # a replay begins: the slot holds another's state
                self.replays, fed = self.replays + 1, {}
            else:                                      # the state it needs (a replay's next chunk: all so far)
                need = range(replay_from if step.start_pos < step.kv_from else
                             step.start_pos - self.replay_tokens(step.start_pos), step.start_pos)
                assert all(fed.get(p) == step.history[p] for p in need), f"slot {slot} lacks the tokens it needs"
            self.fed[slot] = {**fed, **dict(zip(positions.tolist(), step.token_ids))}
        return super().execute(batch)


def requests(seed: int) -> list[list[GenerateRequest]]:
    """Waves of requests: a few shared prefixes (of lengths off the block and the window), then prompts that
    extend them, several at once."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 250) for _ in range(rng.randrange(17, 70))] for _ in range(3)]
    waves = [[GenerateRequest(f"p{i}", p, SamplingParams(temperature=0.8, seed=i, max_tokens=5, ignore_eos=True))
              for i, p in enumerate(prefixes)]]
    for w in range(2):
        waves.append([GenerateRequest(f"w{w}r{i}", rng.choice(prefixes) + [rng.randrange(1, 250) for _ in range(
            rng.randrange(1, 30))], SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randrange(1, 9),
                                                    ignore_eos=True, n=1 + i % 3)) for i in range(5)])
    return waves


def run(seed: int, prefix_caching: bool, num_kv_blocks: int = 64):
    ex = ReplayFake(num_state_slots=5, num_kv_blocks=num_kv_blocks)
    engine = make_engine(ex, max_num_seqs=5, max_num_batched_tokens=24, enable_prefix_caching=prefix_caching)
    outputs = {}
    for wave in requests(seed):
        events = {r.request_id: submit(engine, r) for r in wave}
        run_until_idle(engine)
        for rid, evs in events.items():
            outputs[rid] = sorted((e.index, e.token_id) for e in evs if isinstance(e, Token))
    engine.block_manager.check_invariants(idle=True)
    assert engine.scheduler.state_slots.num_used == 0
    return ex, engine, outputs


def test_prefix_hits_replay_the_state_and_change_nothing():
    for seed in range(3):
        ex, engine, cached = run(seed, prefix_caching=True)
        assert engine.block_manager.enable_prefix_caching and ex.replays > 0
        assert cached == run(seed, prefix_caching=False)[2]
        assert all(cached.values())


def test_replay_through_preemption():
    """A pool too small for the waves: preempted sequences come back through their own cached blocks."""
    ex, engine, cached = run(seed=4, prefix_caching=True, num_kv_blocks=10)
    assert engine.scheduler.num_preemptions > 0 and ex.replays > 0
    assert cached == run(seed=4, prefix_caching=False, num_kv_blocks=10)[2]


def test_a_line_that_cannot_replay_caches_no_prefixes():
    """Qwen3.5's kind of state (replay_tokens None): prefix caching stays off."""
    class NoReplay(ReplayFake):
        replay_tokens = None
    engine = make_engine(NoReplay(num_state_slots=2), max_num_seqs=2)
    assert not engine.block_manager.enable_prefix_caching
