"""Speculative decoding on real model lines through the CPU executor: with speculation on, every request
generates exactly the token ids it generates with speculation off (greedy, and seeded sampling too: the
verification draws each row's token as plain decoding does), with the same logprobs, on tiny random models of
several lines and the demo SmolLM2 — concurrent requests, chunked prefill, preemption, prefix hits, structured
output, n > 1, prompt logprobs, tensor parallel ranks. Drafts come from the ngram proposer and, where a random
model repeats too little for prompt lookup to find much, also from the spec-off run's own continuation with a
share of its tokens corrupted (every verify path taken on every line)."""
from __future__ import annotations

import random

import pytest
from fake_executor import run_until_idle, submit
from test_handle_models import engine_for, loaded
from test_spec_scheduler import ScriptedProposer

from engine.events import Finished, PromptLogprobs, Token
from engine.request import GenerateRequest, SamplingParams
from engine.speculative import SpeculativeConfig

NGRAM = SpeculativeConfig("ngram", 4, 1, 3)
# CPU numpy: the k + 1 rows of a verify step are computed as one chunk, plain decoding one row a step; the
# logprobs of the same tokens agree to float32 rounding (measured max |dlogprob| 2.3e-5 through the server,
# tests/spec/test_spec_server.py); the bound is 2x that
LOGPROB_TOL = 5e-5


def repetitive_requests(name: str, n: int, seed: int, max_tokens: int = 24) -> list[GenerateRequest]:
    """Prompts that repeat a phrase (what prompt lookup drafts from), greedy and seeded sampling mixed."""
    rng = random.Random(seed)
    vocab = loaded(name).config.vocab_size
    reqs = []
    for i in range(n):
        phrase = [rng.randrange(vocab - 200) for _ in range(rng.randrange(2, 8))]
        prompt = [rng.randrange(vocab - 200) for _ in range(rng.randrange(0, 9))] + phrase * rng.randrange(2, 5)
        params = (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2) if i % 3
                  else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                      logprobs=1))
        reqs.append(GenerateRequest(f"r{i}", prompt, params))
    return reqs


def outputs(name: str, reqs, waves: int = 1, drafts_from=None, **config):
    """Per request: [(token id, logprob)] and the finish reason; the engine. drafts_from: a spec-off run's
    outputs, drafted from (30% of the tokens wrong) instead of prompt lookup."""
    engine = engine_for(name, **config)
    if drafts_from is not None:
        reference = {(r.request_id, 0): list(r.prompt_token_ids) + [t for t, _ in toks]
                     for r, (toks, _) in zip(reqs, drafts_from)}
        engine.speculator.proposer = ScriptedProposer(reference, 0.3, loaded(name).config.vocab_size)
    streams = []
    for wave in range(waves):                 # later waves send the same prompts again: prefix hits
        streams += [submit(engine, r) for r in reqs] if wave == 0 else [
            submit(engine, GenerateRequest(f"{r.request_id}-{wave}", r.prompt_token_ids, r.params)) for r in reqs]
        run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    got = [([(e.token_id, e.logprob) for e in sorted(ev, key=index_of) if isinstance(e, Token)],
            [e.reason for e in sorted(ev, key=index_of) if isinstance(e, Finished)]
            + [e.logprobs[1:] for e in ev if isinstance(e, PromptLogprobs)]) for ev in streams]
    return got, engine


def index_of(event) -> int:
    """The sample an event belongs to (n > 1: a verify step sends several tokens of one sample at once)."""
    return getattr(event, "index", -1) if event is not None else 1 << 30


def assert_same(off, on) -> None:
    for (a, ra), (b, rb) in zip(off, on):
        assert [t for t, _ in a] == [t for t, _ in b] and ra == rb
        assert [lp is None for _, lp in a] == [lp is None for _, lp in b]
        lps = [(x, y) for (_, x), (_, y) in zip(a, b) if x is not None]
        assert all(abs(x - y) <= LOGPROB_TOL for x, y in lps)


@pytest.mark.parametrize("name", ["qwen3_tied", "llama", "qwen3_moe", "deepseek_v2"])
def test_ngram_generates_what_plain_decoding_generates(name):
    reqs = repetitive_requests(name, 6, seed=3)
    off, _ = outputs(name, reqs, max_num_batched_tokens=24)
    on, _ = outputs(name, reqs, max_num_batched_tokens=24, speculative_config=NGRAM)
    assert_same(off, on)
    scripted, engine = outputs(name, reqs, max_num_batched_tokens=24, speculative_config=NGRAM, drafts_from=off)
    assert_same(off, scripted)
    c = engine.speculator.counters
    assert c.num_accepted_tokens > 20 and c.num_accepted_tokens < c.num_draft_tokens    # both paths taken
    assert engine.stats().num_steps < sum(len(t) for t, _ in off)


def test_preemption_and_prefix_hits():
    name = "qwen3_tied"
    reqs = repetitive_requests(name, 6, seed=5, max_tokens=40)
    off, _ = outputs(name, reqs, waves=2, num_kv_blocks=14, max_num_seqs=6)
    on, engine = outputs(name, reqs, waves=2, num_kv_blocks=14, max_num_seqs=6, speculative_config=NGRAM)
    assert engine.scheduler.num_preemptions > 0 and engine.stats().prefix_cache_hits > 0
    assert engine.speculator.counters.num_accepted_tokens > 20
    assert_same(off, on)


def test_structured_output_n_and_prompt_logprobs():
    """A JSON schema (drafts the grammar refuses are cut, each verified row masked after the drafts before it),
    n = 3 samples, prompt logprobs: the same tokens with speculation."""
    from server.structured import json_grammar
    name = "qwen3_tied"
    tok = loaded(name).tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["xy", "xy xy"]},
                                                     "maxItems": 6}}, "required": ["a"]}
    prompt = tok.encode('{"a": ["xy", "xy xy", "xy"]} {"a": ["xy xy", "xy"', add_special_tokens=False)
    reqs = [GenerateRequest(f"g{i}", prompt, SamplingParams(temperature=[0, 0.9][i % 2], seed=i, max_tokens=40,
                                                            grammar=json_grammar(schema, "s"), logprobs=1))
            for i in range(4)]
    reqs += [GenerateRequest("n3", prompt, SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=16,
                                                          ignore_eos=True)),
             GenerateRequest("plp", prompt, SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=2,
                                                           ignore_eos=True))]
    off, _ = outputs(name, reqs)
    on, engine = outputs(name, reqs, speculative_config=NGRAM)
    assert_same(off, on)
    assert engine.speculator.counters.num_accepted_tokens > 0


def test_two_tensor_parallel_ranks():
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    from harness.models import tiny_model_path
    reqs = repetitive_requests("qwen3_tied", 3, seed=8, max_tokens=16)
    got = []
    for spec in (None, NGRAM):
        config = EngineConfig(model=tiny_model_path("qwen3_tied"), device="cpu", max_model_len=256, progress=False,
                              tensor_parallel_size=2, speculative_config=spec)
        with EngineHandle(config) as h:
            got.append([r.outputs[0].token_ids for r in h.generate([r.prompt_token_ids for r in reqs],
                                                                   reqs[1].params)])
            stats = h.stats()
    assert got[0] == got[1] and stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.slow
def test_demo_model_with_ngram():
    name = "smollm2"
    tok = loaded(name).tokenizer
    texts = ["List the numbers one two three one two three one two three and continue: one two",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
             "The cat sat on the mat. The cat sat on the mat. The dog"]
    reqs = [GenerateRequest(f"d{i}", tok.encode(t, add_special_tokens=False),
                            SamplingParams(temperature=[0, 0, 0.7][i], seed=i, max_tokens=32, logprobs=1))
            for i, t in enumerate(texts)]
    spec = SpeculativeConfig("ngram", 4, 2, 4)
    off, _ = outputs(name, reqs, max_num_batched_tokens=64)
    on, engine = outputs(name, reqs, max_num_batched_tokens=64, speculative_config=spec)
    assert_same(off, on)
    c = engine.speculator.counters
    assert c.num_accepted_tokens > 0.3 * c.num_draft_tokens > 0


class Fixed:
    """Proposes the same drafts to every sequence."""

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, seqs, limits):
        return [self.drafts for _ in seqs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_past_the_grammars_end(temperature):
    """Drafts that complete the grammar and run on into EOS: the sequence ends where its grammar does (the
    matcher keeps no rollback record of tokens taken after it stopped, so verification stops there)."""
    from server.structured import choice_grammar
    name = "qwen3_tied"
    tok = loaded(name).tokenizer
    words = tok.encode("alpha beta gamma", add_special_tokens=False)
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=10, logprobs=1,
                            grammar=choice_grammar(["alpha beta gamma", "alpha delta"], "c"))
    req = GenerateRequest("g", tok.encode("Say it:", add_special_tokens=False), params)
    off, _ = outputs(name, [req])
    said = [t for t, _ in off[0][0]]
    assert tok.decode(said) in ("alpha beta gamma", "alpha delta")
    engine = engine_for(name, speculative_config=NGRAM)
    engine.speculator.proposer = Fixed(said[1:] + tok.eos_token_ids + words)
    events = submit(engine, req)
    engine.step()                                 # the prefill: its first token, "alpha"
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    assert [e.token_id for e in events if isinstance(e, Token)] == said
    assert [e.reason for e in events if isinstance(e, Finished)] == ["stop"]
    assert engine.speculator.counters.num_accepted_tokens >= 1
