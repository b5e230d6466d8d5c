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
