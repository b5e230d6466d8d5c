"""Speculative decoding beside the host KV tier, its copies synchronous and asynchronous: a prompt's prefix pushed
out of a small device pool to the tier comes back for the same prompt sent again (the free-running gate's
prefix-hit-host-tier path). Every request generates what plain decoding without a tier generates (the fake model
reads its whole context back through the block table: a wrong restore or rollback changes its tokens), and once
the last request is done the engine goes idle only with every block given back: a write-through of the blocks
the last (verify) step filled, issued or not, is landed first, not left holding its block while nothing runs."""
from __future__ import annotations

import pytest
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit
from test_host_tier import cached, tokens
from test_host_tier_async import AsyncCopies
from test_spec_scheduler import ScriptedProposer

from engine.request import GenerateRequest, SamplingParams
from engine.speculative import SpeculativeConfig

NGRAM = SpeculativeConfig("ngram", 4, 1, 3)
PROMPT = list(range(30, 130))                   # 100 tokens: 6 full blocks to restore
OTHERS = [[200 + i] + list(range(1, 70)) for i in range(8)]     # push PROMPT's blocks out to the tier


def requests(max_tokens: int) -> list[GenerateRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [("a1", PROMPT)] + [(f"o{i}", p) for i, p in enumerate(OTHERS)] + [("a2", PROMPT)]
    return [GenerateRequest(rid, list(p), params) for rid, p in prompts]


def one_by_one(engine, reqs) -> dict[str, list]:
    """Each request alone after the one before, the engine run until idle (no copy landed by hand): its events."""
    events = {}
    for req in reqs:
        events[req.request_id] = submit(engine, req)
        run_until_idle(engine)
        engine.block_manager.check_invariants(idle=True)
    return events


@pytest.mark.parametrize("max_tokens", [12, 13], ids=["last-step-in-a-block", "last-step-fills-a-block"])
@pytest.mark.parametrize("copies", ["sync", "async", "async-slow"])
@pytest.mark.parametrize("spec", [False, True], ids=["spec-off", "spec-on"])
def test_host_tier_prefix_hit_ends_idle_with_every_block_given_back(spec, copies, max_tokens):
    reqs = requests(max_tokens)
    plain = one_by_one(make_engine(FakeExecutor(num_kv_blocks=64)), reqs)
    ex = (FakeExecutor(num_kv_blocks=12, host_kv_blocks=64) if copies == "sync"
          else AsyncCopies(delay=2 if copies == "async" else 6, write_delay=1 if copies == "async" else 4,
                           num_kv_blocks=12, host_kv_blocks=64))
    engine = make_engine(ex, host_kv_blocks=64, speculative_config=NGRAM if spec else None)
    if spec:
        reference = {(r.request_id, 0): r.prompt_token_ids + tokens(plain[r.request_id]) for r in reqs}
        engine.speculator.proposer = ScriptedProposer(reference, 0.3, ex.vocab_size)
    got = one_by_one(engine, reqs)
    assert {rid: tokens(ev) for rid, ev in got.items()} == {rid: tokens(ev) for rid, ev in plain.items()}
    assert cached(got["a2"]) == 96 and engine.scheduler.host_tier.slots.restored_blocks >= 1
    if spec:
        assert engine.speculator.counters.num_accepted_tokens > 10
    tier = engine.scheduler.host_tier
    assert not tier.writing and not tier.draining and not tier.restoring and tier.slots._held == {}
