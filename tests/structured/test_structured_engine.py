"""Structured output in the engine (CPU executor): every output under a JSON schema validates against it
across seeds, temperatures and filters on the tiny models (real Qwen tokenizer) and SmolLM2; regex and
choice outputs match exactly; grammars compile once; unconstrained requests in the same batches
generate exactly what they generate alone."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from engine.batch import SeqStep
from engine.events import Error, Finished, Rejected, Token
from engine.grammar import GrammarCache, allowed_tokens, only_stop_tokens, step_bitmask
from engine.request import GenerateRequest, SamplingParams
from engine.sampling import sample_step
from fake_executor import run_until_idle, submit
from server.structured import choice_grammar, json_grammar, lark_grammar, regex_grammar
from test_handle_models import engine_for, loaded

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "ok": {"type": "boolean"},
                         "nick": {"type": ["string", "null"], "maxLength": 6}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
TEMPERATURES = (0.0, 0.6, 1.0, 1.5)


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Token))


def finish_of(events) -> Finished:
    return next(e for e in events if isinstance(e, (Finished, Rejected)))


def constrained(name: str, grammar: str, seeds: range, max_tokens: int = 120, **extra) -> list[list]:
    """One engine, every seed's request at once (temperatures, top_k / top_p varied by seed)."""
    engine = engine_for(name, num_kv_blocks=256, max_num_seqs=64)
    prompt = loaded(name).tokenizer.encode("Describe a person as JSON:", add_special_tokens=False)
    got = []
    for seed in seeds:
        params = SamplingParams(temperature=TEMPERATURES[seed % 4], seed=seed, max_tokens=max_tokens,
                                top_k=[-1, 40][seed % 2], top_p=[1.0, 0.9][seed // 2 % 2], grammar=grammar, **extra)
        got.append(submit(engine, GenerateRequest(f"r{seed}", prompt, params)))
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    return got


@pytest.mark.parametrize("name", ["qwen3_tied", "llama"])
def test_every_output_under_a_schema_validates(name):
    grammar = json_grammar(SCHEMA, "schema")
    outs = constrained(name, grammar, range(50))
    for seed, events in enumerate(outs):
        text = text_of(events)
        assert finish_of(events).reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text_of(e) for e in outs}) > 10            # seeds and temperatures do vary the outputs


@pytest.mark.slow
def test_smollm2_outputs_validate():
    grammar = json_grammar(SCHEMA, "schema")
    for seed, events in enumerate(constrained("smollm2", grammar, range(50))):
        assert finish_of(events).reason == "stop", (seed, text_of(events))
        jsonschema.validate(json.loads(text_of(events)), SCHEMA)


def test_regex_and_choice_are_exact_and_n_samples_each_follow_it():
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    for events in constrained("qwen3_tied", regex_grammar(pattern, "regex"), range(12)):
        assert re.fullmatch(pattern, text_of(events)), text_of(events)
    choices = ["yes", "no", "maybe so", "n/a (see {})"]
    outs = constrained("qwen3_tied", choice_grammar(choices, "choice"), range(12), n=3)
    for events in outs:
        for index in range(3):
            text = "".join(e.text for e in events if isinstance(e, Token) and e.index == index)
            assert text in choices, text
    assert len({text_of(e) for e in outs}) > 1


def test_lark_grammar_and_ignore_eos_end_with_the_grammar():
    lark = lark_grammar('start: "(" num (" + " num){0,3} ")"\nnum: /[1-9][0-9]?/', "grammar")
    for events in constrained("qwen3_tied", lark, range(8), max_tokens=60, ignore_eos=True):
        assert re.fullmatch(r"\((\d{1,2})( \+ \d{1,2}){0,3}\)", text_of(events)), text_of(events)
        assert finish_of(events).reason == "stop"


def test_bad_grammar_is_rejected_by_admission():
    engine = engine_for("qwen3_tied")
    events = submit(engine, GenerateRequest("bad", [1, 2, 3], SamplingParams(grammar=regex_grammar("[a-", "r"))))
    assert isinstance(events[0], Rejected) and "unclosed character class" in events[0].reason


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours():
    name = "qwen3_tied"
    vocab = loaded(name).config.vocab_size
    rng = np.random.default_rng(3)
    plain = [GenerateRequest(f"p{i}", rng.integers(0, vocab - 300, 9).tolist(),
                             SamplingParams(temperature=[0.0, 1.0][i % 2], seed=i, max_tokens=10, ignore_eos=True))
             for i in range(6)]

    def run(with_grammar: bool):
        engine = engine_for(name, num_kv_blocks=128)
        got = [submit(engine, r) for r in plain]
        if with_grammar:
            for i in range(6):
                submit(engine, GenerateRequest(f"g{i}", [5, 6, 7], SamplingParams(
                    temperature=1.0, seed=i, max_tokens=40, grammar=json_grammar(SCHEMA, "s"))))
        run_until_idle(engine)
        return [[e.token_id for e in events if isinstance(e, Token)] for events in got]
    assert run(True) == run(False)


def test_grammar_cache_compiles_once_and_matchers_are_independent():
    tok = loaded("qwen3_tied").tokenizer
    cache = GrammarCache(tok, None, tok.eos_token_ids)
    grammar = choice_grammar(["alpha", "beta"], "c")
    a, b = cache.matcher(grammar), cache.matcher(grammar)
    assert cache.compiles == 1
    assert cache.check(regex_grammar("(", "r")) is not None and cache.check(regex_grammar("(", "r")) is not None
    assert cache.compiles == 2                      # errors are cached too
    ids = tok.encode("alpha", add_special_tokens=False)
    assert all(a.accept(t) for t in ids) and a.done and not b.done
    c = b.fork()
    assert b.accept(tok.encode("beta", add_special_tokens=False)[0]) and not c.done
    rows, masks = step_bitmask([None, c, None])
    allowed = np.flatnonzero(allowed_tokens(masks[0], 151936))
    assert rows == [1] and {tok.decode([int(t)]) for t in allowed} <= {"a", "al", "alp", "alph", "alpha",
                                                                      "b", "be", "bet", "beta"}


def test_host_sampler_applies_the_mask_and_min_tokens_yields_to_it():
    tok = loaded("qwen3_tied").tokenizer
    cache = GrammarCache(tok, None, tok.eos_token_ids)
    matcher = cache.matcher(choice_grammar(["x"], "c"))
    assert matcher.accept(tok.encode("x", add_special_tokens=False)[0])
    eos = tok.eos_token_ids
    logits = np.random.default_rng(0).standard_normal((2, 151936)).astype(np.float32)
    steps = [SeqStep(seq_id=i, token_ids=[1], start_pos=3, block_table=[0], sample=True,
                     params=SamplingParams(temperature=t, seed=1, min_tokens=5, stop_token_ids=eos),
                     num_generated=1, grammar=matcher.fork()) for i, t in enumerate((0.0, 1.0))]
    _, masks = step_bitmask([s.grammar for s in steps])
    assert only_stop_tokens(allowed_tokens(masks[0], 151936), eos)
    assert all(t.token_id in eos for t in sample_step(logits, steps))     # not masked by min_tokens


def test_a_grammar_failing_while_generating_fails_its_request_and_is_refused_after(monkeypatch):
    """A matcher that goes past llguidance's limits mid-generation (the probe skipped, so `a{1000000}`
    reaches generation) ends its request with an Error naming why — never a Finished with text the grammar
    does not match: the failed matcher's masks allow only EOS, and the shared lexer, spent, failed every
    later copy at its first mask (issue 51: a 500, then a 200 with ""). The grammar is then refused at
    admission; an unconstrained neighbour runs on unchanged."""
    from engine import grammar
    monkeypatch.setattr(grammar, "PROBE_WALKS", 0)
    engine = engine_for("qwen3_tied", num_kv_blocks=128)
    bad = regex_grammar("a{1000000}", "regex")
    first = submit(engine, GenerateRequest("g1", [5, 6, 7], SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                                                                           grammar=bad)))
    plain = submit(engine, GenerateRequest("p", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)))
    run_until_idle(engine)
    (error,) = [e for e in first if isinstance(e, Error)]
    assert "structured output failed: lexer error" in error.message and first[-1] is None
    assert not any(isinstance(e, (Finished, Token)) for e in first), first
    assert finish_of(plain).reason == "length" and len([e for e in plain if isinstance(e, Token)]) == 6
    for rid in ("g2", "g3"):
        events = submit(engine, GenerateRequest(rid, [5, 6, 7], SamplingParams(temperature=1.0, seed=2, max_tokens=8,
                                                                                grammar=bad)))
        run_until_idle(engine)
        assert isinstance(events[0], Rejected) and "past the engine's limits while generating" in events[0].reason
    engine.block_manager.check_invariants(idle=True)


def test_a_failed_matcher_refuses_even_eos():
    tok = loaded("qwen3_tied").tokenizer
    matcher = GrammarCache(tok, None, tok.eos_token_ids).matcher(choice_grammar(["x"], "c"))
    assert not matcher.accept(tok.encode("y", add_special_tokens=False)[0])
    assert matcher.error and not matcher.done
    assert not matcher.accept(tok.eos_token_ids[0])          # llguidance "consumes" it in its error state
