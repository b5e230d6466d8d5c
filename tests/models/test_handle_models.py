"""The engine on real model lines through the CPU executor: tiny random-weight models (fast)
and the SmolLM2 demo model (slow): batching, chunking, prefix caching and preemption never
change what a request generates."""
import functools
import random

import pytest

from engine.events import Finished, Scheduled, Token
from engine.request import GenerateRequest, SamplingParams
from fake_executor import make_engine, run_until_idle, submit


@functools.lru_cache(maxsize=None)
def loaded(name):
    from engine.loader import load_model
    if name == "smollm2":
        from engine.loader.demo import demo_model_path
        return load_model(demo_model_path())
    from harness.models import tiny_model_path
    return load_model(tiny_model_path(name))


def engine_for(name, num_kv_blocks=64, **config):
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    model = loaded(name)
    ex = CpuExecutor(model, options_of(num_kv_blocks=num_kv_blocks, max_model_len=512))
    return make_engine(ex, model.tokenizer, max_model_len=512, **config)


def tokens(events, index=0):
    return [e.token_id for e in events if isinstance(e, Token) and e.index == index]


def run(name, reqs, **config):
    engine = engine_for(name, **config)
    got = [submit(engine, r) for r in reqs]
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    return got, engine


def alone(name, r, **config):
    return run(name, [r], **config)[0][0]


def random_requests(name, n, seed, max_tokens=12, sampled_every=2):
    rng = random.Random(seed)
    vocab = loaded(name).config.vocab_size
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(vocab - 200) for _ in range(rng.randrange(3, 60))]
        params = (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) if i % sampled_every
                  else SamplingParams(temperature=1.0, top_k=50, seed=i, max_tokens=max_tokens, ignore_eos=True))
        reqs.append(GenerateRequest(f"r{i}", prompt, params))
    return reqs


@pytest.mark.parametrize("name", ["qwen3_tied", "llama"])
def test_batched_chunked_equals_alone(name):
    reqs = random_requests(name, 6, seed=1)
    batched, engine = run(name, reqs, max_num_batched_tokens=32)
    assert engine.stats().num_steps > 12                # chunked prefill took extra steps
    for r, events in zip(reqs, batched):
        solo = alone(name, r, max_num_batched_tokens=2048)
        assert tokens(events) == tokens(solo), r.request_id
        assert len(tokens(events)) == 12


def test_prefix_cache_hit_equals_miss():
    name = "qwen3_tied"
    rng = random.Random(2)
    shared = [rng.randrange(5000) for _ in range(40)]
    first = GenerateRequest("a", shared + [11, 12], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    second = GenerateRequest("b", shared + [13], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine = engine_for(name)
    a = submit(engine, first)
    run_until_idle(engine)
    b = submit(engine, second)
    run_until_idle(engine)
    # two whole blocks, then a partial hit: a's third block (cached once its output filled it) shares
    # shared[32:40], copied into b's own block before b computes from token 40
    assert b[0] == Scheduled("b", 40)
    assert [e for e in b if isinstance(e, Finished)][0].usage.cached_tokens == 40
    assert tokens(b) == tokens(alone(name, second, enable_prefix_caching=False))
    assert tokens(a) == tokens(alone(name, first, enable_prefix_caching=False))


@pytest.mark.parametrize("name", ["qwen3_tied", "llama"])
def test_prompt_sent_again_computes_one_token_with_the_same_logprobs(name):
    """A prompt of whole blocks sent again, and again with its last token changed: the second sequence
    copies the cached last block (copy-on-write) and computes one token; its sampled tokens' logprobs
    equal a run without prefix caching (float32: within 1e-4)."""
    vocab = loaded(name).config.vocab_size
    rng = random.Random(9)
    prompt = [rng.randrange(vocab - 200) for _ in range(48)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    engine = engine_for(name)
    for rid, ids, cached in (("a", prompt, 0), ("b", prompt, 47), ("c", prompt[:-1] + [prompt[-1] + 1], 47)):
        events = submit(engine, GenerateRequest(rid, ids, params))
        run_until_idle(engine)
        assert events[0] == Scheduled(rid, cached)
        cold = alone(name, GenerateRequest(rid, ids, params), enable_prefix_caching=False)
        assert tokens(events) == tokens(cold)
        got = [e.logprob for e in events if isinstance(e, Token)]
        want = [e.logprob for e in cold if isinstance(e, Token)]
        assert max(abs(x - y) for x, y in zip(got, want)) < 1e-4
    engine.block_manager.check_invariants(idle=True)


def test_preemption_tiny_pool_identical():
    name = "qwen3_untied"
    reqs = random_requests(name, 5, seed=3, max_tokens=30)
    got, engine = run(name, reqs, num_kv_blocks=9, enable_prefix_caching=False)
    assert engine.scheduler.num_preemptions > 0
    for r, events in zip(reqs, got):
        assert tokens(events) == tokens(alone(name, r)), r.request_id


def test_seed_reproducible_across_batch_compositions():
    name = "qwen2"
    reqs = random_requests(name, 4, seed=4, sampled_every=1)
    together, _ = run(name, reqs)
    other = random_requests(name, 3, seed=99)
    for r in other:
        r.request_id = 'other-' + r.request_id
    order = other[:1] + reqs[2:] + other[1:] + reqs[:2]
    mixed, _ = run(name, order, max_num_batched_tokens=24)
    by_id = {r.request_id: ev for r, ev in zip(order, mixed) if r in reqs}
    for r, a in zip(reqs, together):
        assert tokens(a) == tokens(by_id[r.request_id]) == tokens(alone(name, r)), r.request_id
        assert len(tokens(a)) == 12


def test_n_samples_on_a_real_model():
    name = "qwen3_gqa4"
    rng = random.Random(5)
    prompt = [rng.randrange(5000) for _ in range(37)]
    events, engine = run(name, [GenerateRequest("a", prompt, SamplingParams(
        n=3, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True))])
    outs = [tokens(events[0], i) for i in range(3)]
    from engine.sequence import sample_seed
    for i in range(3):
        solo = alone(name, GenerateRequest("x", prompt, SamplingParams(
            temperature=1.0, seed=sample_seed(9, i), max_tokens=8, ignore_eos=True)))
        assert outs[i] == tokens(solo)


@pytest.mark.slow
def test_smollm2_batching_prefix_cache_and_stop_string():
    name = "smollm2"
    tok = loaded(name).tokenizer
    prompts = ["The capital of France is",
               "List three colors of the rainbow, one per line, and say nothing else at all:"]
    reqs = [GenerateRequest(f"p{i}", tok.encode(p), SamplingParams(temperature=0, max_tokens=8))
            for i, p in enumerate(prompts)]
    batched, engine = run(name, reqs, max_num_batched_tokens=16)
    solo = [alone(name, r) for r in reqs]
    for b, s in zip(batched, solo):
        assert tokens(b) == tokens(s)
    text0 = "".join(e.text for e in batched[0] if isinstance(e, Token))
    assert "Paris" in text0
    assert text0 == tok.decode(tokens(batched[0]), skip_special_tokens=True)
    # the same prompt again hits the prefix cache (its full blocks) and gives the same tokens
    assert len(reqs[1].prompt_token_ids) > 16
    again = submit(engine, GenerateRequest("again", reqs[1].prompt_token_ids,
                                           SamplingParams(temperature=0, max_tokens=3)))
    run_until_idle(engine)
    assert again[0].cached_tokens == 16 and tokens(again) == tokens(batched[1])[:3]
    # a stop string spanning a token boundary ends the text right before it
    pieces = [e.text for e in batched[0] if isinstance(e, Token)]
    cut = next(i for i in range(1, len(pieces)) if pieces[i - 1] and pieces[i])
    stop = pieces[cut - 1][-1] + pieces[cut][:1]
    before = "".join(pieces[:cut])[:-1]
    if stop in before:
        pytest.skip("stop string occurs earlier")
    stopped = alone(name, GenerateRequest("s", reqs[0].prompt_token_ids,
                                          SamplingParams(temperature=0, max_tokens=8, stop=[stop])))
    assert "".join(e.text for e in stopped if isinstance(e, Token)) == before
    assert [e.stop_reason for e in stopped if isinstance(e, Finished)] == [stop]


@pytest.mark.slow
def test_random_traffic_with_aborts_on_a_tiny_model():
    from test_scheduler import random_traffic
    engine = engine_for("qwen3_tied", num_kv_blocks=20, max_num_batched_tokens=64, max_num_seqs=8)
    aborted, preemptions = random_traffic(engine, vocab=5000, num_requests=100, max_tokens=12)
    assert aborted > 5 and preemptions > 0


def test_abort_mid_generation_through_the_handle():
    import asyncio
    import time
    from engine.config import EngineConfig
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.handle import EngineHandle
    model = loaded("qwen3_tied")
    h = EngineHandle(EngineConfig(), executor=CpuExecutor(model, options_of(num_kv_blocks=32, max_model_len=512)),
                     tokenizer=model.tokenizer, max_model_len=512)

    async def go():
        seen = []
        async for e in h.submit(GenerateRequest("a", list(range(100, 150)), SamplingParams(
                max_tokens=300, ignore_eos=True))):
            seen.append(e)
            if sum(isinstance(x, Token) for x in seen) == 2:
                h.abort("a")
        return seen

    try:
        events = asyncio.run(go())
        assert events[-1].reason == "abort" and events[-1].usage.completion_tokens < 300
        for _ in range(200):
            if h.stats().kv_blocks_used == 0 and h.stats().num_requests == 0:
                break
            time.sleep(0.01)
        assert h.stats().kv_blocks_used == 0
        h.engine.block_manager.check_invariants(idle=True)
    finally:
        h.shutdown()


@pytest.mark.parametrize("budget", [2048, 16])
def test_prompt_and_sample_logprobs_match_teacher_forced_logits(budget):
    import numpy as np
    from engine.events import PromptLogprobs
    from harness.models import engine_logits, log_softmax
    name = "qwen3_tied"
    rng = random.Random(6)
    prompt = [rng.randrange(5000) for _ in range(45)]
    events, engine = run(name, [GenerateRequest("a", prompt, SamplingParams(
        temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=3, ignore_eos=True))],
        max_num_batched_tokens=budget)
    events = events[0]
    out = tokens(events)
    lp = log_softmax(engine_logits(engine.executor, [prompt + out])[0])
    plp = next(e for e in events if isinstance(e, PromptLogprobs))
    want = lp[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(plp.logprobs[1:], want, atol=2e-4)
    assert [t.token_id for t in plp.top_logprobs[5]] == list(np.argsort(-lp[4])[:3])
    toks = [e for e in events if isinstance(e, Token)]
    for k, e in enumerate(toks):
        row = lp[len(prompt) - 1 + k]
        assert e.token_id == int(np.argmax(row))
        assert abs(e.logprob - row[e.token_id]) < 2e-4
        assert [t.token_id for t in e.top_logprobs] == list(np.argsort(-row)[:5])
