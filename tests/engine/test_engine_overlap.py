"""CPU/GPU step overlap in the engine loop, with a fake executor that launches asynchronously: its
step runs only when the engine asks for the result, after the engine has sent the previous step's
deferred tokens. Every client-visible event must equal what a synchronous executor gives, through
stop strings (which end a sequence one step late on the executor's side), stop tokens, lengths,
n > 1, logprobs, preemption and aborts."""
from __future__ import annotations

import dataclasses

from engine.events import Finished, Scheduled, Token
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit


class LaunchedStep:
    def __init__(self, executor, batch, fed: bool = False):
        self.executor, self.batch, self.fed = executor, batch, fed

    def result(self):
        self.executor.log.append(("result", len(self.executor.steps)))
        if self.fed:        # the leading rows' ids are the sampled ids of the step run just before, row for row
            fed = self.batch.fed_rows()
            self.executor.fed_rows.append((fed, self.batch.num_tokens))
            self.batch.input_ids[:fed] = self.executor.last_ids[:fed]
        out = self.executor.execute(self.batch)
        self.executor.last_ids = [t.token_id for t in out.sampled]
        return out


class AsyncFakeExecutor(FakeExecutor):
    """submit() returns at once; the step runs in result() (fed steps take their ids then)."""
    supports_fed_steps = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log: list[tuple] = []
        self.last_ids: list[int] = []
        self.fed_steps = 0
        self.fed_rows: list[tuple[int, int]] = []     # (fed rows, tokens) of each fed step

    def submit(self, batch, fed: bool = False):
        self.log.append(("launch", len(self.steps)))
        self.fed_steps += fed
        return LaunchedStep(self, batch, fed)


def requests() -> list[GenerateRequest]:
    greedy = dict(temperature=0.0)
    return [
        GenerateRequest("plain", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True, **greedy)),
        GenerateRequest("eos", [9, 9, 9], SamplingParams(max_tokens=200, **greedy)),
        GenerateRequest("stopstr", list(b"the rain"), SamplingParams(max_tokens=120, stop=["e", "a"], **greedy)),
        GenerateRequest("stopid", [1, 2], SamplingParams(max_tokens=120, stop_token_ids=[101, 102, 103, 104, 105],
                                                         **greedy)),
        GenerateRequest("minlen", [3], SamplingParams(max_tokens=30, min_tokens=10, stop=["a"], **greedy)),
        GenerateRequest("sampled", [4, 4], SamplingParams(max_tokens=25, temperature=1.0, seed=7, n=3,
                                                          logprobs=2, ignore_eos=True)),
        GenerateRequest("long", list(range(60, 100)), SamplingParams(max_tokens=90, ignore_eos=True, **greedy)),
    ]


def client_view(events: list) -> list:
    """What a client sees (cached-token counts depend on prefix-cache timing, not on the model)."""
    out = []
    for e in events:
        if isinstance(e, Scheduled):
            continue
        if isinstance(e, Finished):
            e = dataclasses.replace(e, usage=dataclasses.replace(e.usage, cached_tokens=0))
        out.append(e)
    return out


def run(executor, reqs, **config) -> dict[str, list]:
    config.setdefault("async_scheduling", False)   # overlap alone; async scheduling (on by default) is asked for
    engine = make_engine(executor, **config)
    streams = {r.request_id: [] for r in reqs}
    log = getattr(executor, "log", [])
    for r in reqs:
        engine.add_request(r, lambda e, out=streams[r.request_id]: (out.append(e), log.append(("event", e))))
    run_until_idle(engine)
    return {rid: client_view(ev) for rid, ev in streams.items()}


def test_overlapped_engine_sends_what_the_synchronous_one_sends():
    sync = run(FakeExecutor(), requests())
    lagged = AsyncFakeExecutor()
    overlapped = run(lagged, requests())
    assert overlapped == sync
    assert all(ev and ev[-1] is None for ev in sync.values())
    reasons = {rid: [e.reason for e in ev if isinstance(e, Finished)] for rid, ev in sync.items()}
    assert reasons["stopstr"] == ["stop"] and reasons["stopid"] == ["stop"] and reasons["plain"] == ["length"]
    # the overlap happened: tokens of a step were sent after the next step's launch, before its result
    kinds = [entry[0] if entry[0] != "event" or not isinstance(entry[1], Token) else "token" for entry in lagged.log]
    overlapped_sends = sum(1 for i in range(len(kinds) - 2)
                           if kinds[i] == "launch" and kinds[i + 1] == "token" and "result" in kinds[i + 1:])
    assert overlapped_sends > 10


def test_stop_string_costs_one_extra_executor_step_but_no_extra_token():
    req = requests()[2]                           # stops on the first "e" or "a"
    sync_ex, lagged = FakeExecutor(), AsyncFakeExecutor()
    sync, overlapped = run(sync_ex, [req]), run(lagged, [req])
    assert overlapped == sync
    tokens = [e for e in sync["stopstr"] if isinstance(e, Token)]
    assert tokens and len(lagged.steps) == len(sync_ex.steps) + 1


def test_overlap_through_preemption_and_aborts():
    """A KV pool too small for everyone: sequences are preempted with a token still to be sent."""
    reqs = [GenerateRequest(f"r{i}", [10 + i] * 20, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                                                   stop=["\x7f"]))
            for i in range(6)]
    sync = run(FakeExecutor(num_kv_blocks=14), reqs, max_num_seqs=6)
    lagged = AsyncFakeExecutor(num_kv_blocks=14)
    engine = make_engine(lagged, max_num_seqs=6, async_scheduling=False)
    streams = {r.request_id: submit(engine, r) for r in reqs}
    assert run_until_idle(engine) > 0 and engine.scheduler.num_preemptions > 0
    assert {rid: client_view(ev) for rid, ev in streams.items()} == sync

    engine = make_engine(AsyncFakeExecutor(), async_scheduling=False)
    events = submit(engine, requests()[0])
    engine.step()
    engine.step()                                 # one token sent, one deferred
    engine.abort("plain")
    run_until_idle(engine)
    finished = [e for e in events if isinstance(e, Finished)]
    assert [f.reason for f in finished] == ["abort"] and events[-1] is None
    assert all(not isinstance(e, Token) for e in events[events.index(finished[0]):])


def test_ends_known_from_the_token_cost_no_extra_step():
    """Stop tokens, max_tokens and max_model_len end a sequence before the next launch (an extra step
    could run past max_model_len); only stop strings, which need the text, are one step late."""
    reqs = [r for r in requests() if not r.params.stop]
    reqs.append(GenerateRequest("fills", [7] * 20, SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True)))
    sync_ex, lagged = FakeExecutor(), AsyncFakeExecutor()
    assert run(lagged, reqs, max_model_len=64) == run(sync_ex, reqs, max_model_len=64)
    assert len(lagged.steps) == len(sync_ex.steps)


def decode_feeds(executor) -> list[list[tuple[int, int]]]:
    """(token id, position) fed per decode-only step: what a step computes, whichever blocks it uses."""
    return [list(zip(b.input_ids.tolist(), b.positions.tolist())) for b in executor.steps if b.is_decode_only]


def test_steps_planned_ahead_equal_freshly_scheduled_ones():
    """With schedule_ahead, decode steps are scheduled and built while the previous one runs and
    confirmed (tokens patched in) after it: the same events and the same fed tokens as scheduling
    each step afresh, through stop strings, stop tokens, n > 1, logprobs and arrivals."""
    ahead_ex, fresh_ex = AsyncFakeExecutor(), AsyncFakeExecutor()
    ahead_engine = make_engine(ahead_ex, async_scheduling=False)
    streams = {r.request_id: submit(ahead_engine, r) for r in requests()}
    run_until_idle(ahead_engine)
    fresh = run(fresh_ex, requests(), schedule_ahead=False)
    assert {rid: client_view(ev) for rid, ev in streams.items()} == fresh == run(FakeExecutor(), requests())
    assert decode_feeds(ahead_ex) == decode_feeds(fresh_ex)
    planned = ahead_engine.stats().num_steps_planned_ahead
    assert planned > 0.5 * len(decode_feeds(ahead_ex))        # most decode steps were planned ahead
    assert all(t >= 0 for feed in decode_feeds(ahead_ex) for t, _ in feed)   # no placeholder reached a step


def test_plan_is_dropped_when_the_running_set_changes():
    """An arrival, an abort or an end between the plan and its step: the plan is not used."""
    ex = AsyncFakeExecutor()
    engine = make_engine(ex, async_scheduling=False)
    a = submit(engine, GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0,
                                                                         ignore_eos=True)))
    for _ in range(4):
        engine.step()
    assert engine._plan is not None
    b = submit(engine, GenerateRequest("b", [8, 9], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    engine.drain_inbox()
    planned = engine._planned_steps
    engine.step()                                  # b waits: the plan is dropped, b is admitted
    assert engine._planned_steps == planned and len(ex.steps[-1].seqs) == 2
    engine.step()                                  # planned behind the mixed step (b's prefill was its last chunk)
    assert engine._planned_steps == planned + 1
    engine.abort("b")
    engine.drain_inbox()
    engine.step()                                  # b aborted after the plan was made
    assert engine._planned_steps == planned + 1 and len(ex.steps[-1].seqs) == 1
    run_until_idle(engine)
    sync = run(FakeExecutor(), [GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0,
                                                                                ignore_eos=True))])
    assert client_view(a) == sync["a"]
    assert [e.reason for e in b if isinstance(e, Finished)] == ["abort"]


def test_busy_server_plans_ahead_with_a_queue():
    """max_num_seqs reached with requests queued (a busy server): nobody can join, so decode steps are
    still planned ahead, and queued requests join as soon as a running one ends, as with fresh scheduling."""
    reqs = [GenerateRequest(f"q{i}", [20 + i] * (3 + i), SamplingParams(max_tokens=12 + 5 * i, temperature=0.0,
                                                                        ignore_eos=True)) for i in range(6)]
    ahead_ex, fresh_ex = AsyncFakeExecutor(), AsyncFakeExecutor()
    engine = make_engine(ahead_ex, max_num_seqs=2, async_scheduling=False)
    streams = {r.request_id: submit(engine, r) for r in reqs}
    run_until_idle(engine)
    fresh = run(fresh_ex, reqs, max_num_seqs=2, schedule_ahead=False)
    assert {rid: client_view(ev) for rid, ev in streams.items()} == fresh
    assert decode_feeds(ahead_ex) == decode_feeds(fresh_ex)
    assert [len(b.seqs) for b in ahead_ex.steps] == [len(b.seqs) for b in fresh_ex.steps]
    assert engine.stats().num_steps_planned_ahead > 0.5 * len(decode_feeds(ahead_ex))


def test_async_scheduling_sends_what_the_synchronous_engine_sends():
    """Decode steps queued before the step ahead of them is read (their ids taken from its output, as
    the GPU does on the device) give every client the same events, through stop strings, stop ids,
    lengths, n > 1, logprobs, and a pool small enough to preempt."""
    sync = run(FakeExecutor(), requests())
    ex = AsyncFakeExecutor()
    assert run(ex, requests(), async_scheduling=True) == sync
    assert ex.fed_steps > 50
    reqs = [GenerateRequest(f"r{i}", [10 + i] * 20, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
            for i in range(6)]
    small = AsyncFakeExecutor(num_kv_blocks=14)
    assert run(small, reqs, max_num_seqs=6, async_scheduling=True) == run(FakeExecutor(num_kv_blocks=14), reqs,
                                                                          max_num_seqs=6)


def test_async_scheduling_queues_the_next_step_before_waiting():
    """One sequence decoding: after the first decode, every step is launched before the result of the
    one ahead of it is read (launch, launch, result, ...), and none runs past max_tokens."""
    ex = AsyncFakeExecutor()
    out = run(ex, [requests()[0]], async_scheduling=True)
    assert len([e for e in out["plain"] if isinstance(e, Token)]) == 40
    outstanding, queued_behind = 0, 0          # steps launched and not yet read, at each read
    for kind, *_ in ex.log:
        outstanding += {"launch": 1, "result": -1}.get(kind, 0)
        queued_behind += kind == "result" and outstanding == 1      # another step already queued
    assert queued_behind >= 35 and len(ex.steps) == 40


def test_async_scheduling_never_feeds_a_step_whose_sampling_counts_the_history():
    """Penalties count the tokens generated so far: a step queued before the previous token reached the
    host would sample without it. Such sequences decode step by step; the tokens equal the synchronous
    engine's, and a request without penalties beside them is still not fed alone."""
    class Checked(AsyncFakeExecutor):
        def submit(self, batch, fed: bool = False):
            assert not (fed and any(s.params.repetition_penalty != 1.0 or s.params.frequency_penalty
                                    or s.params.presence_penalty for s in batch.seqs)), "penalised row fed"
            return super().submit(batch, fed)

    reqs = [GenerateRequest("rep", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                             repetition_penalty=1.3)),
            GenerateRequest("freq", [8, 9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                           frequency_penalty=0.5)),
            GenerateRequest("plain", [3, 4], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))]
    ex = Checked()
    assert run(ex, reqs, async_scheduling=True) == run(FakeExecutor(), reqs)
    assert ex.fed_steps == 0
    alone = Checked()
    run(alone, [reqs[2]], async_scheduling=True)
    assert alone.fed_steps > 10


def test_a_first_token_is_sent_with_its_step_not_after_the_next_launch():
    """The step after a prefill is not launched ahead (its input is the prefill's token), so a deferred
    first token would wait through that step's scheduling and launch: it goes out with its own step; the
    later tokens still go out after the next launch."""
    engine = make_engine(AsyncFakeExecutor())
    events = submit(engine, GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True)))
    engine.step()                                  # the prefill: its token is the request's first
    assert len([e for e in events if isinstance(e, Token)]) == 1
    engine.step()                                  # the first decode: its token waits for the next launch
    assert len([e for e in events if isinstance(e, Token)]) == 1
    run_until_idle(engine)
    assert len([e for e in events if isinstance(e, Token)]) == 8


def test_the_first_decode_is_queued_behind_its_prefill():
    """Async scheduling: the step after a prompt's last chunk is launched before that chunk's token is known
    (its input id taken on the device, as for decodes), so its scheduling and launch overlap the prefill;
    also behind a mixed step whose prompts all end in it. Tokens as a synchronous executor gives them."""
    ex = AsyncFakeExecutor()
    engine = make_engine(ex)
    req = GenerateRequest("a", list(range(5, 45)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    events = submit(engine, req)
    engine.step()                                  # the prefill, and the first decode queued behind it
    assert ex.log[:3] == [("launch", 0), ("launch", 0), ("result", 0)] and ex.fed_steps == 1
    run_until_idle(engine)
    assert client_view(events) == run(FakeExecutor(), [req])["a"]
    reqs = requests()
    lagged = AsyncFakeExecutor()
    assert run(lagged, reqs, async_scheduling=True) == run(FakeExecutor(), reqs)
    assert lagged.fed_steps > 0


def per_choice(events: list) -> dict:
    """A client's events by choice (n > 1 samples stream interleaved in an order that follows the steps)."""
    out: dict = {}
    for e in events:
        out.setdefault(getattr(e, "index", None), []).append(e)
    return out


def test_prompts_arriving_while_others_decode_join_steps_queued_ahead():
    """Async scheduling with prompts arriving while others decode: each joins the step queued behind the
    one running (a mixed step: the decodes' ids taken on the device, the prompt's from the host), through
    prefix hits (whole and partial blocks), n > 1, stop ids and strings, logprobs, chunked prompts, a pool
    small enough to preempt and a host KV tier: every client sees what a synchronous engine sends."""
    import numpy as np

    rng = np.random.default_rng(11)
    shared = [int(t) for t in rng.integers(1, 250, 40)]
    mixed_steps = 0
    for trial in range(6):
        reqs, arrivals = [], []
        for i in range(12):
            base = shared[: int(rng.integers(0, 40))] if rng.random() < 0.5 else []
            prompt = base + [int(t) for t in rng.integers(1, 250, int(rng.integers(1, 30)))]
            p = dict(max_tokens=int(rng.integers(1, 40)), temperature=float(rng.choice([0.0, 1.0])), seed=i,
                     ignore_eos=bool(rng.random() < 0.7))
            if rng.random() < 0.2:
                p["n"] = 2
            if rng.random() < 0.2:
                p["stop"] = ["e"]
            if rng.random() < 0.2:
                p["stop_token_ids"] = [int(t) for t in rng.integers(1, 250, 5)]
            if rng.random() < 0.2:
                p["logprobs"] = 2
            reqs.append(GenerateRequest(f"t{trial}r{i}", prompt, SamplingParams(**p)))
            arrivals.append(int(rng.integers(0, 60)))
        config = dict(max_num_seqs=int(rng.choice([3, 6])), max_num_batched_tokens=int(rng.choice([24, 64])))
        blocks = int(rng.choice([24, 64]))
        host = int(rng.choice([0, 16]))
        ex = AsyncFakeExecutor(num_kv_blocks=blocks, host_kv_blocks=host)
        engine = make_engine(ex, async_scheduling=True, host_kv_blocks=host, **config)
        streams = {r.request_id: [] for r in reqs}
        order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
        step = 0
        while order or engine.has_work():
            while order and arrivals[order[0]] <= step:
                r = reqs[order.pop(0)]
                engine.add_request(r, streams[r.request_id].append)
            engine.drain_inbox()
            if engine.has_work():
                engine.step()
            step += 1
        sync = run(FakeExecutor(num_kv_blocks=blocks, host_kv_blocks=host), reqs, host_kv_blocks=host, **config)
        assert {rid: per_choice(client_view(ev)) for rid, ev in streams.items()} == \
            {rid: per_choice(ev) for rid, ev in sync.items()}, trial
        mixed_steps += sum(fed < tokens for fed, tokens in ex.fed_rows)
    assert mixed_steps > 10


def test_a_prompt_arriving_during_a_decode_is_queued_with_the_next_decodes():
    """Async scheduling: a prompt that arrives while a sequence decodes joins the step queued behind the
    running one (its rows after the fed decode row), not a step scheduled after that one's result."""
    ex = AsyncFakeExecutor()
    engine = make_engine(ex)
    a = submit(engine, GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    b = submit(engine, GenerateRequest("b", list(range(20, 45)), SamplingParams(max_tokens=5, temperature=0.0,
                                                                                ignore_eos=True)))
    engine.step()                                  # runs the decode queued before b arrived, queues the mixed step
    assert len(ex.steps[-1].seqs) == 1 and engine._inflight is not None
    assert [len(s.token_ids) for s in engine._inflight[1].seqs] == [1, 25]
    engine.step()                                  # the mixed step runs: a's id fed, b's 25 from the host
    assert ex.fed_rows[-1] == (1, 26) and engine.stats().num_prompts_admitted_ahead == 1
    run_until_idle(engine)
    sync = run(FakeExecutor(), [GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0,
                                                                                ignore_eos=True)),
                                GenerateRequest("b", list(range(20, 45)), SamplingParams(max_tokens=5, temperature=0.0,
                                                                                         ignore_eos=True))])
    assert client_view(a) == sync["a"] and client_view(b) == sync["b"]


def test_aborts_of_prompts_admitted_into_steps_queued_ahead():
    """Requests aborted right after arriving (their prompt possibly admitted into a step already queued):
    each ends with an abort or its own end, the others stream what a synchronous engine sends, and every
    block comes back."""
    import numpy as np

    rng = np.random.default_rng(3)
    for trial in range(8):
        reqs = [GenerateRequest(f"a{trial}r{i}", [int(t) for t in rng.integers(1, 250, int(rng.integers(1, 40)))],
                                SamplingParams(max_tokens=int(rng.integers(2, 30)), temperature=0.0, ignore_eos=True))
                for i in range(10)]
        arrivals = [int(rng.integers(0, 40)) for _ in reqs]
        doomed = {int(i) for i in rng.choice(len(reqs), 3, replace=False)}
        ex = AsyncFakeExecutor(num_kv_blocks=40)
        engine = make_engine(ex, async_scheduling=True, max_num_seqs=4, max_num_batched_tokens=32)
        streams = {r.request_id: [] for r in reqs}
        order, step, pending_aborts = sorted(range(len(reqs)), key=lambda i: arrivals[i]), 0, []
        while order or engine.has_work() or pending_aborts:
            for rid in pending_aborts:
                engine.abort(rid)
            pending_aborts = []
            while order and arrivals[order[0]] <= step:
                i = order.pop(0)
                engine.add_request(reqs[i], streams[reqs[i].request_id].append)
                if i in doomed:
                    pending_aborts.append(reqs[i].request_id)   # aborted after the next step is queued
            engine.drain_inbox()
            if engine.has_work():
                engine.step()
            step += 1
        engine.block_manager.check_invariants(idle=True)
        sync = run(FakeExecutor(num_kv_blocks=40), [r for i, r in enumerate(reqs) if i not in doomed],
                   max_num_seqs=4, max_num_batched_tokens=32)
        for i, r in enumerate(reqs):
            events = client_view(streams[r.request_id])
            assert events[-1] is None and isinstance(events[-2], Finished), (trial, r.request_id)
            if i in doomed:
                assert all(not isinstance(e, Token) for e in events[events.index(events[-2]):-1])
            else:
                assert events == sync[r.request_id], (trial, r.request_id)


def test_a_prompt_waits_for_the_prefix_blocks_of_the_step_in_flight():
    """Async scheduling plans the next step while this one runs, before this step's prompt blocks are
    cached: a prompt arriving meanwhile whose next block this step fills is not admitted into the plan
    (it would compute the block again) but in the step after, with the prefix hit a synchronous engine
    gives it."""
    shared = list(range(30, 78))                   # 3 full blocks
    greedy = dict(temperature=0.0, ignore_eos=True)
    ex = AsyncFakeExecutor()
    engine = make_engine(ex)
    submit(engine, GenerateRequest("x", [5, 6, 7], SamplingParams(max_tokens=40, **greedy)))
    for _ in range(3):
        engine.step()
    a = submit(engine, GenerateRequest("a", shared + [1, 2], SamplingParams(max_tokens=5, **greedy)))
    engine.step()                                  # x's decode runs; a's prefill is queued behind it
    assert [len(s.token_ids) for s in engine._inflight[1].seqs] == [1, 50]
    b = submit(engine, GenerateRequest("b", shared + [9, 9, 9], SamplingParams(max_tokens=5, **greedy)))
    engine.step()                                  # a's prefill runs; b's first 3 blocks are in it: b waits
    assert len(engine._inflight[1].seqs) == 2      # x and a decode, b not admitted yet
    run_until_idle(engine)
    scheduled = [e for e in b if isinstance(e, Scheduled)]
    assert scheduled[0].cached_tokens == 48
    first_b = next(st for batch in ex.steps for st in batch.seqs if st.seq_id == 3)
    assert len(first_b.token_ids) == 3 and first_b.start_pos == 48      # the 3 blocks are not computed again
    sync = run(FakeExecutor(), [GenerateRequest("a", shared + [1, 2], SamplingParams(max_tokens=5, **greedy)),
                                GenerateRequest("b", shared + [9, 9, 9], SamplingParams(max_tokens=5, **greedy))])
    assert client_view(a) == sync["a"] and client_view(b) == sync["b"]


def test_a_prompt_chunked_over_several_steps_is_queued_ahead_chunk_by_chunk():
    """Async scheduling with a small step budget: a long prompt's chunks after the first are queued behind
    the step before (their ids are the prompt's; the decode beside them takes its id on the device), and
    its first decode behind its last chunk; both requests stream what a synchronous engine sends."""
    ex = AsyncFakeExecutor()
    engine = make_engine(ex, max_num_batched_tokens=16)
    greedy = dict(temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest("x", [5, 6, 7], SamplingParams(max_tokens=30, **greedy)),
            GenerateRequest("long", list(range(30, 100)), SamplingParams(max_tokens=4, **greedy))]
    x = submit(engine, reqs[0])
    for _ in range(3):
        engine.step()
    long = submit(engine, reqs[1])
    run_until_idle(engine)
    chunked = [(fed, tokens) for fed, tokens in ex.fed_rows if tokens == 16]    # x's decode + a 15-token chunk
    assert len(chunked) >= 3
    sync = run(FakeExecutor(), reqs, max_num_batched_tokens=16)
    assert client_view(x) == sync["x"] and client_view(long) == sync["long"]
