"""Scheduler and engine loop on a deterministic fake model that really reads its paged KV:
continuous batching, chunked prefill, prefix caching, preemption, n > 1, aborts."""
import random

import numpy as np
import pytest

from engine.events import Finished, Scheduled, Token
from engine.request import GenerateRequest, SamplingParams
from engine.sequence import sample_seed
from memory.prefix_hash import hash_chain
from fake_executor import EOS, FakeExecutor, make_engine, run_until_idle, submit


def tokens(events, index=0):
    return [e.token_id for e in events if isinstance(e, Token) and e.index == index]


def text(events, index=0):
    return "".join(e.text for e in events if isinstance(e, Token) and e.index == index)


def finished(events):
    return [e for e in events if isinstance(e, Finished)]


def req(rid, prompt, **params):
    return GenerateRequest(rid, list(prompt), SamplingParams(**params))


def prompt_of(rng, n):
    return [rng.randrange(256) for _ in range(n)]


def alone(r, **config):
    """The events of r run by itself on a fresh engine."""
    engine = make_engine(**config)
    events = submit(engine, r)
    run_until_idle(engine)
    return events


def test_chunked_prefill_budget_mixes_decodes_and_prefills():
    ex = FakeExecutor()
    engine = make_engine(ex, max_num_batched_tokens=32)
    rng = random.Random(0)
    a = submit(engine, req("a", prompt_of(rng, 10), temperature=0, max_tokens=30))
    engine.step()                                       # a: whole prompt
    b = submit(engine, req("b", prompt_of(rng, 100), temperature=0, max_tokens=5))
    run_until_idle(engine)
    sizes = [[len(s.token_ids) for s in batch.seqs] for batch in ex.steps]
    assert all(sum(s) <= 32 for s in sizes)
    assert [1, 31] in sizes                             # a decodes while b's prefill is chunked
    assert tokens(a) == tokens(alone(req("a", a_prompt := ex.steps[0].seqs[0].token_ids,
                                         temperature=0, max_tokens=30)))
    assert len(a_prompt) == 10 and len(tokens(b)) == 5
    engine.block_manager.check_invariants(idle=True)


def test_continuous_batching_matches_alone_greedy_and_seeded():
    rng = random.Random(1)
    reqs = []
    for i in range(12):
        params = dict(temperature=0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=100 + i)
        reqs.append(req(f"r{i}", prompt_of(rng, rng.randrange(1, 70)), max_tokens=rng.randrange(1, 40),
                        ignore_eos=True, **params))
    engine = make_engine(max_num_batched_tokens=48, max_num_seqs=5)
    got = {}
    for r in reqs[:6]:
        got[r.request_id] = submit(engine, r)
    late = iter(reqs[6:])
    def join(step):                                      # the rest arrive while others decode
        if step % 3 == 0:
            r = next(late, None)
            if r is not None:
                got[r.request_id] = submit(engine, r)
    run_until_idle(engine, on_step=join)
    for r in reqs[6:]:
        if r.request_id not in got:
            got[r.request_id] = submit(engine, r)
    run_until_idle(engine)
    for r in reqs:
        assert tokens(got[r.request_id]) == tokens(alone(r)), r.request_id
        assert len(tokens(got[r.request_id])) == r.params.max_tokens
    engine.block_manager.check_invariants(idle=True)


def test_prefix_cache_hit_same_output_and_cached_tokens():
    rng = random.Random(2)
    p = prompt_of(rng, 50)
    engine = make_engine()
    first = submit(engine, req("a", p, temperature=0, max_tokens=20))
    run_until_idle(engine)
    second = submit(engine, req("b", p, temperature=0, max_tokens=20))
    third = submit(engine, req("c", p[:40] + [7, 7, 7], temperature=0, max_tokens=20))
    run_until_idle(engine)
    assert first[0] == Scheduled("a", 0)
    # c: two whole blocks, then a partial hit on a's third block (it shares p[32:40])
    assert second[0] == Scheduled("b", 48) and third[0] == Scheduled("c", 40)
    assert tokens(second) == tokens(first)
    assert finished(second)[0].usage.cached_tokens == 48
    uncached = alone(req("c", p[:40] + [7, 7, 7], temperature=0, max_tokens=20),
                     enable_prefix_caching=False)
    assert tokens(third) == tokens(uncached)
    assert engine.stats().prefix_cache_hits == 88 and engine.stats().prefix_cache_queries == 50 + 50 + 43
    engine.block_manager.check_invariants(idle=True)


def test_prompt_of_exact_blocks_computes_its_last_token_on_a_copy():
    """The last block of a prompt sent again is cached whole, but its last token must be computed (its
    logits): the sequence takes a copy of the block (copy-on-write, the cached one never written) and
    computes one token, not the block's 16; the cached block is held until that step is done."""
    p = list(range(32))
    ex = FakeExecutor()
    engine = make_engine(ex)
    a = submit(engine, req("a", p, temperature=0, max_tokens=3))
    run_until_idle(engine)
    bm = engine.block_manager
    last = bm.lookup(hash_chain(p, 16))[1]
    b = submit(engine, req("b", p, temperature=0, max_tokens=3))
    engine.step()
    first = ex.steps[-1]
    assert [len(s.token_ids) for s in first.seqs] == [1] and first.seqs[0].start_pos == 31
    own = first.seqs[0].block_table[1]
    assert first.block_copies.tolist() == [[last, own]] and own != last
    assert bm.ref_counts[last] == 0 and last in bm._lru                # released once the step is done
    run_until_idle(engine)
    assert b[0].cached_tokens == 31 and tokens(a) == tokens(b)
    assert all(not s.block_copies.size for s in ex.steps[ex.steps.index(first) + 1:])
    bm.check_invariants(idle=True)

    ex2 = FakeExecutor()
    ex2.supports_block_copies = False                  # an executor that cannot copy: the whole block again
    engine = make_engine(ex2)
    for rid in "ab":
        events = submit(engine, req(rid, p, temperature=0, max_tokens=3))
        run_until_idle(engine)
    assert events[0].cached_tokens == 16 and tokens(events) == tokens(a)


def test_preemption_under_tiny_pool_same_output():
    rng = random.Random(3)
    reqs = [req(f"r{i}", prompt_of(rng, 20 + i), temperature=0 if i % 2 else 1.0, seed=i,
                max_tokens=40, ignore_eos=True) for i in range(6)]
    ex = FakeExecutor(num_kv_blocks=12)                 # each request needs 4-5 blocks
    engine = make_engine(ex, enable_prefix_caching=False)
    got = [submit(engine, r) for r in reqs]
    run_until_idle(engine)
    assert engine.scheduler.num_preemptions > 0
    for r, events in zip(reqs, got):
        assert tokens(events) == tokens(alone(r)), r.request_id
        assert [f.reason for f in finished(events)] == ["length"]
    engine.block_manager.check_invariants(idle=True)


def test_n_samples_share_prompt_blocks_and_match_their_seeds():
    rng = random.Random(4)
    p = prompt_of(rng, 40)
    engine = make_engine()
    events = submit(engine, req("a", p, n=3, seed=5, temperature=1.0, max_tokens=10, ignore_eos=True))
    shared = None
    while engine.scheduler.has_work():
        engine.step()
        seqs = engine.scheduler.running
        if len(seqs) == 3 and shared is None:
            shared = seqs[0].block_table[:2]
            assert all(s.block_table[:2] == shared for s in seqs)
            assert all(engine.block_manager.ref_counts[b] == 3 for b in shared)
    assert shared is not None
    assert [e.index for e in finished(events)] and sorted(e.index for e in finished(events)) == [0, 1, 2]
    outs = [tokens(events, i) for i in range(3)]
    assert len({tuple(o) for o in outs}) == 3
    for i in range(3):
        one = alone(req("x", p, seed=sample_seed(5, i), temperature=1.0, max_tokens=10, ignore_eos=True))
        assert outs[i] == tokens(one)
    assert sum(isinstance(e, Scheduled) for e in events) == 1
    engine.block_manager.check_invariants(idle=True)


def test_max_num_seqs_and_fcfs():
    ex = FakeExecutor()
    engine = make_engine(ex, max_num_seqs=3)
    for i in range(7):
        submit(engine, req(f"r{i}", [i + 1] * 5, temperature=0, max_tokens=4, ignore_eos=True))
    run_until_idle(engine)
    assert max(len(b.seqs) for b in ex.steps) == 3
    order = []
    for b in ex.steps:
        for s in b.seqs:
            if s.start_pos == 0:
                order.append(s.token_ids[0])
    assert order == list(range(1, 8))


def test_eos_stop_ids_min_tokens_ignore_eos():
    p = [1, 2, 3]
    force_eos = {EOS: 100.0}
    events = alone(req("a", p, temperature=0, max_tokens=10, logit_bias=force_eos))
    assert tokens(events) == [EOS] and finished(events)[0].reason == "stop"
    assert finished(events)[0].stop_reason is None and text(events) == ""
    events = alone(req("a", p, temperature=0, max_tokens=10, logit_bias=force_eos, min_tokens=3))
    assert len(tokens(events)) == 4 and tokens(events)[:3].count(EOS) == 0 and tokens(events)[3] == EOS
    events = alone(req("a", p, temperature=0, max_tokens=6, logit_bias=force_eos, ignore_eos=True))
    assert tokens(events) == [EOS] * 6 and finished(events)[0].reason == "length"
    events = alone(req("a", p, temperature=0, max_tokens=10, logit_bias={65: 100.0}, stop_token_ids=[65]))
    assert tokens(events) == [65] and finished(events)[0].stop_reason == 65 and text(events) == ""


def test_stop_string_across_token_boundary_end_to_end():
    ids = [ord(c) for c in "abcSTOPdef"]
    engine = make_engine(ScriptedExecutor(ids))
    events = submit(engine, req("s", [5, 6, 7], temperature=0, max_tokens=30, stop=["STOP"]))
    run_until_idle(engine)
    assert text(events) == "abc" and finished(events)[0].stop_reason == "STOP"
    assert len(tokens(events)) == 7                     # the tokens that completed the stop are counted
    assert finished(events)[0].usage.completion_tokens == 7
    engine = make_engine(ScriptedExecutor(ids))
    events = submit(engine, req("s", [5, 6, 7], temperature=0, max_tokens=8, stop=["STOP"], min_tokens=8))
    run_until_idle(engine)                              # before min_tokens, stop strings do not stop
    assert text(events) == "abcSTOPd" and finished(events)[0].reason == "length"


class ScriptedExecutor(FakeExecutor):
    """Greedy outputs follow a script: logits put the next scripted token on top."""
    def __init__(self, script, **kw):
        super().__init__(**kw)
        self.script = script

    def forward_logits(self, batch):
        logits = super().forward_logits(batch)
        row = 0
        for s in batch.seqs:
            for p in range(s.start_pos, s.context_len):
                k = p + 1 - s.prompt_len
                if 0 <= k < len(self.script):
                    logits[row, self.script[k]] = 1e3
                row += 1
        return logits


def test_prompt_logprobs_match_the_model():
    ex = FakeExecutor()
    engine = make_engine(ex, max_num_batched_tokens=16)
    p = list(range(40, 80))                             # longer than the budget: chunked
    events = submit(engine, req("a", p, temperature=0, max_tokens=2, prompt_logprobs=2, n=2))
    run_until_idle(engine)
    chunks = [(s.start_pos, len(s.token_ids)) for b in ex.steps for s in b.seqs if s.want_prompt_logprobs]
    assert len(chunks) > 2 and all(n <= 16 for _, n in chunks)
    assert all((start + n) % 16 for start, n in chunks[:-1])   # never completes a block mid-prompt
    plp = [e for e in events if type(e).__name__ == "PromptLogprobs"]
    assert len(plp) == 1 and plp[0].token_ids == p and plp[0].logprobs[0] is None
    ref = FakeExecutor()
    logits = np.stack([ref._row_logits(np.asarray(p[:i + 1])) for i in range(len(p) - 1)])
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    want = logits[np.arange(len(p) - 1), p[1:]] - lse
    np.testing.assert_allclose(plp[0].logprobs[1:], want, atol=1e-4)
    assert all(len(t) == 2 for t in plp[0].top_logprobs[1:])
    assert sorted(f.index for f in finished(events)) == [0, 1]
    engine.block_manager.check_invariants(idle=True)


def test_failing_step_errors_its_requests_engine_survives():
    ex = FakeExecutor(fail_on_token=255)
    engine = make_engine(ex)
    bad = submit(engine, req("bad", [255, 1], temperature=0, max_tokens=3))
    run_until_idle(engine)
    good = submit(engine, req("good", [1, 2], temperature=0, max_tokens=3, logit_bias={255: -100}))
    run_until_idle(engine)
    assert type(bad[-2]).__name__ == "Error" and "injected failure" in bad[-2].message
    assert bad[-1] is None
    assert finished(good)[0].reason == "length"
    engine.block_manager.check_invariants(idle=True)


@pytest.mark.parametrize("prompt, params, match", [
    ([], {}, "prompt is empty"),
    ([1, 999], {}, "out of the vocabulary"),
    ([1] * 500, {"max_tokens": 20}, "exceeds max_model_len"),
    ([1], {"n": 99}, "n must be <="),
    ([1], {"temperature": -1}, "temperature"),
    ([1], {"logit_bias": {5000: 1.0}}, "out of the vocabulary"),
])
def test_rejections_name_the_problem(prompt, params, match):
    engine = make_engine()
    events = submit(engine, req("r", prompt, **params))
    assert type(events[0]).__name__ == "Rejected" and match in events[0].reason
    assert events[1:] == [None]
    assert not engine.scheduler.has_work()


def random_traffic(engine, vocab, num_requests=200, seed=7, max_tokens=50):
    """num_requests random requests (shared prefixes, n > 1, stops, logprobs, prompt logprobs)
    arriving over time, with random aborts; checks the block manager along the way and that
    every request ended properly. Returns (aborted requests, preemptions)."""
    rng = random.Random(seed)
    total = engine.block_manager.num_blocks
    events, n_of = {}, {}
    shared = [rng.randrange(vocab) for _ in range(40)]
    pending = []
    for i in range(num_requests):
        prompt = (shared[:rng.randrange(0, 40)] if rng.random() < 0.5 else []) + \
            [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        n = rng.choice([1, 1, 1, 2, 3])
        params = dict(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, max_tokens), n=n, seed=i,
                      stop=rng.choice([[], ["ab"], ["\n", "zz"]]), logprobs=rng.choice([None, 2]),
                      prompt_logprobs=rng.choice([None, None, None, 1]), min_tokens=rng.choice([0, 1]))
        pending.append(req(f"r{i}", prompt, **params))
        n_of[f"r{i}"] = n
    step = 0
    while pending or engine.scheduler.has_work():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                r = pending.pop(0)
                events[r.request_id] = submit(engine, r)
        if events and rng.random() < 0.15:
            engine.abort(rng.choice(list(events)))
        engine.drain_inbox()
        if engine.scheduler.has_work():
            engine.step()
        step += 1
        if step % 25 == 0:
            engine.block_manager.check_invariants()
    engine.block_manager.check_invariants(idle=True)
    assert engine.block_manager.num_free_blocks == total and not engine.requests
    aborted = 0
    for rid, ev in events.items():
        assert ev[-1] is None and None not in ev[:-1], rid
        ends = finished(ev)
        assert sorted(e.index for e in ends) == list(range(n_of[rid])), (rid, ev[:3])
        aborted += any(e.reason == "abort" for e in ends)
        for e in ends:
            if e.reason != "abort":
                assert e.usage.completion_tokens == len(tokens(ev, e.index))
    return aborted, engine.scheduler.num_preemptions


def test_random_requests_with_aborts_leave_block_manager_clean():
    engine = make_engine(FakeExecutor(num_kv_blocks=20), max_num_batched_tokens=64, max_num_seqs=8)
    aborted, preemptions = random_traffic(engine, vocab=256)
    assert aborted > 10 and preemptions > 0


def test_consumer_that_goes_away_aborts_its_request():
    engine = make_engine()
    seen = []

    def sink(event):
        seen.append(event)
        if len(seen) >= 3:
            raise RuntimeError("event loop is closed")

    engine.add_request(req("gone", [1, 2, 3], max_tokens=200, ignore_eos=True), sink)
    run_until_idle(engine)
    assert len([e for e in seen if isinstance(e, Token)]) < 10
    assert not engine.requests
    engine.block_manager.check_invariants(idle=True)


def test_lora_name_is_rejected_clearly():
    engine = make_engine()
    r = req("l", [1, 2])
    r.lora_name = "my-adapter"
    events = submit(engine, r)
    assert "LoRA is not enabled" in events[0].reason


def test_preemption_takes_the_youngest_first():
    engine = make_engine(FakeExecutor(num_kv_blocks=5), enable_prefix_caching=False)
    submit(engine, req("old", [1] * 20, max_tokens=50, ignore_eos=True))
    submit(engine, req("young", [2] * 20, max_tokens=50, ignore_eos=True))
    while engine.scheduler.num_preemptions == 0:
        engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["old"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["young"]
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
