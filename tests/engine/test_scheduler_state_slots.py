"""Per-sequence state slots through the scheduler and the engine loop (a fake executor that keeps, per
slot, the tokens its state has absorbed): every step finds its slot holding exactly the sequence's
tokens before start_pos (or starts it fresh at position 0), no two running sequences share a slot, a
prompt-logprobs chunk never re-feeds a token, and finish, abort and preemption give every slot back."""
from __future__ import annotations

import random

from engine.events import Error
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit


class StatefulFake(FakeExecutor):
    """FakeExecutor whose model keeps per-sequence state: slot s holds the tokens fed to it."""

    def __init__(self, num_state_slots: int, **kw):
        super().__init__(**kw)
        self.num_state_slots = num_state_slots
        self.absorbed: dict[int, list[int]] = {}

    def execute(self, batch):
        slots = batch.state_slots.tolist()
        assert len(set(slots)) == len(slots) and all(0 <= s < self.num_state_slots for s in slots), slots
        for step, slot in zip(batch.seqs, slots):
            have = [] if step.start_pos == 0 else self.absorbed.get(slot, [])
            assert len(have) == step.start_pos, f"slot {slot}: state of {len(have)} tokens, step at {step.start_pos}"
            assert have == step.history[:step.start_pos], f"slot {slot} holds another sequence's state"
            self.absorbed[slot] = have + list(step.token_ids)
        return super().execute(batch)


def run_random(seed: int, num_kv_blocks: int, budget: int, abort_every: int = 0):
    rng = random.Random(seed)
    ex = StatefulFake(num_state_slots=6, num_kv_blocks=num_kv_blocks)
    engine = make_engine(ex, max_num_seqs=6, max_num_batched_tokens=budget)
    reqs = []
    for i in range(14):
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randrange(1, 12), ignore_eos=True,
                                n=rng.choice([1, 1, 2, 3]), prompt_logprobs=rng.choice([None, None, 1]))
        reqs.append(GenerateRequest(f"r{i}", [rng.randrange(1, 250) for _ in range(rng.randrange(1, 50))], params))
    events = [submit(engine, r) for r in reqs]

    def maybe_abort(step):
        if abort_every and step % abort_every == 0:
            engine.abort(f"r{rng.randrange(14)}")
    run_until_idle(engine, on_step=maybe_abort)
    return engine, events


def test_slots_follow_every_sequence_through_chunks_forks_and_preemption():
    engine, events = run_random(seed=1, num_kv_blocks=12, budget=24)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.state_slots.num_used == 0
    assert all(e and e[-1] is None for e in events)
    assert not [x for e in events for x in e if isinstance(x, Error)]
    engine.block_manager.check_invariants(idle=True)


def test_aborts_give_slots_back():
    engine, _ = run_random(seed=2, num_kv_blocks=40, budget=32, abort_every=3)
    assert engine.scheduler.state_slots.num_used == 0
    assert not engine.block_manager.enable_prefix_caching


def test_the_check_fails_when_a_prompt_token_is_re_fed():
    """With the re-feed of a line without state, the stateful fake's check fails the request (so the
    tests above can fail)."""
    ex = StatefulFake(num_state_slots=2)
    engine = make_engine(ex, max_num_seqs=2, max_num_batched_tokens=16)
    engine.scheduler._overlap = lambda seq: int(seq.want_prompt_logprobs and 0 < seq.num_computed < seq.prompt_len)
    events = submit(engine, GenerateRequest("a", list(range(1, 40)), SamplingParams(max_tokens=1, prompt_logprobs=0)))
    run_until_idle(engine)
    errors = [e for e in events if isinstance(e, Error)]
    assert errors and "state of" in errors[0].message
    assert engine.scheduler.state_slots.num_used == 0
