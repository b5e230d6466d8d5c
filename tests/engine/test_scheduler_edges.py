"""Edge cases of the engine loop a client can reach through the OpenAI API (fake model)."""
from engine.events import Error, Finished, Token
from engine.request import GenerateRequest, SamplingParams
from fake_executor import make_engine, run_until_idle, submit


def tokens(events, index=0):
    return [e.token_id for e in events if isinstance(e, Token) and e.index == index]


def test_negative_seed_samples_and_does_not_fail_its_batch():
    """OpenAI (and the server) accept any int64 seed; a negative one must sample reproducibly
    and must not take down the other requests of its step."""
    engine = make_engine()
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    neg = submit(engine, GenerateRequest("neg", [1, 2, 3], SamplingParams(seed=-5, **params)))
    other = submit(engine, GenerateRequest("other", [4, 5, 6], SamplingParams(seed=1, **params)))
    run_until_idle(engine)
    for events in (neg, other):
        assert not any(isinstance(e, Error) for e in events), events
        assert [e.reason for e in events if isinstance(e, Finished)] == ["length"]
    again = make_engine()
    rerun = submit(again, GenerateRequest("neg", [1, 2, 3], SamplingParams(seed=-5, **params)))
    run_until_idle(again)
    assert tokens(rerun) == tokens(neg) and len(tokens(neg)) == 6
    engine.block_manager.check_invariants(idle=True)


def test_mixed_traffic_in_a_tiny_pool_matches_each_request_alone():
    """Shared prefixes (prompts of 1, 15-17, 31-33, 47-48 tokens: exact block multiples included),
    n > 1, prompt logprobs, stop strings, min_tokens, chunked prefill and preemption in a tiny
    pool: every sample's tokens, text and prompt logprobs equal the request run alone."""
    import random

    from engine.events import PromptLogprobs
    from fake_executor import FakeExecutor

    def text(events, index):
        return "".join(e.text for e in events if isinstance(e, Token) and e.index == index)

    def plp(events):
        return next((e.logprobs for e in events if isinstance(e, PromptLogprobs)), None)

    for trial in range(12):
        rng = random.Random(trial)
        base = [rng.randrange(256) for _ in range(48)]
        reqs = []
        for i in range(rng.randrange(3, 8)):
            plen = rng.choice([1, 15, 16, 17, 31, 32, 33, 47, 48])
            prompt = base[:plen] if rng.random() < 0.6 else [rng.randrange(256) for _ in range(plen)]
            max_tokens = rng.randrange(1, 25)
            params = SamplingParams(
                temperature=rng.choice([0, 1.0]), seed=rng.randrange(100), max_tokens=max_tokens,
                n=rng.choice([1, 1, 2, 3]), ignore_eos=rng.random() < 0.5,
                stop=rng.choice([[], ["a"], ["xyz", "q"]]),
                min_tokens=rng.randrange(0, max_tokens + 1) if rng.random() < 0.3 else 0,
                prompt_logprobs=2 if rng.random() < 0.3 else None,
                logprobs=1 if rng.random() < 0.3 else None)
            reqs.append(GenerateRequest(f"r{i}", prompt, params))
        config = dict(max_num_batched_tokens=rng.choice([16, 20, 64]), max_num_seqs=rng.choice([3, 8]))
        engine = make_engine(FakeExecutor(num_kv_blocks=rng.choice([8, 12, 40])), **config)
        got = [submit(engine, r) for r in reqs]
        run_until_idle(engine)
        engine.block_manager.check_invariants(idle=True)
        for r, events in zip(reqs, got):
            one = make_engine(**config)
            ref = submit(one, GenerateRequest("x", r.prompt_token_ids, r.params))
            run_until_idle(one)
            assert plp(events) == plp(ref), (trial, r.request_id)
            ends = sorted((e.index, e.reason, e.usage.completion_tokens) for e in events
                          if isinstance(e, Finished))
            assert ends == sorted((e.index, e.reason, e.usage.completion_tokens) for e in ref
                                  if isinstance(e, Finished)), (trial, r.request_id)
            for i in range(r.params.n):
                assert tokens(events, i) == tokens(ref, i), (trial, r.request_id, i)
                assert text(events, i) == text(ref, i), (trial, r.request_id, i)
