"""Speculative decoding on the lines with per-sequence state, through the numpy executor. Qwen3.5 (Gated DeltaNet
state slots): a verify step's draft tokens are held out of the conv windows and recurrent states, and the accepted
ones applied at the sequence's next step (engine/executor/cpu_deltanet_ops.py HeldDrafts). DeepSeek-V4 (compressor
rings): the rings are sized for the drafts (DeepseekV4ForCausalLM.make_room_for_drafts), so what a rejected draft
stores is never read. Either way every request generates exactly what it generates with speculation off —
concurrent requests of different lengths, chunked prefill, greedy and seeded sampling, preemption, an abort
mid-speculation — through verify steps that accept every draft, some, and none. With the rollback disabled (or the
rings left at the windows' reach) the outputs differ: the comparison can fail. (Prefix caching is off for Qwen3.5:
no hits.) Method 'eagle3' is refused for Qwen3.5, and 'mtp' for a folder without its MTP module, with their reason."""
from __future__ import annotations

import functools
import random

import pytest
from fake_executor import make_engine, run_until_idle, submit
from test_spec_engine import NGRAM, assert_same, index_of
from test_spec_scheduler import ScriptedProposer

from engine.events import Finished, Token
from engine.executor import cpu_deltanet_ops
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.request import GenerateRequest, SamplingParams
from harness.hybrid_models import hybrid_model_path
from harness.models import tiny_model_path

MODELS = ("qwen3_5_text", "qwen3_5", "deepseek_v4")


def loaded(name: str):
    """A fresh load (make_room_for_drafts resizes DeepSeek-V4's rings on the model it is given), its weights read
    once."""
    from engine.loader import load_model
    return load_model(_path(name))


@functools.lru_cache(maxsize=None)
def _path(name: str) -> str:
    return hybrid_model_path(name) if name.startswith("qwen3_5") else tiny_model_path(name)


def engine_for(name: str, num_kv_blocks: int = 64, **config):
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    model = loaded(name)
    spec = config.get("speculative_config")
    executor = CpuExecutor(model, options_of(num_kv_blocks=num_kv_blocks, max_model_len=512,
                                             num_speculative_tokens=spec.num_speculative_tokens if spec else 0))
    return make_engine(executor, model.tokenizer, max_model_len=512, **config)


def requests(name: str, n: int, seed: int, max_tokens: int = 24, sampled: bool = True) -> list[GenerateRequest]:
    """Random prompts of 3 to 40 tokens; greedy, and (sampled) seeded sampling every third request."""
    rng = random.Random(seed)
    vocab = loaded(name).config.vocab_size
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(vocab - 200) for _ in range(rng.randrange(3, 41))]
        params = (SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                 logprobs=1) if sampled and i % 3 == 0
                  else SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
        reqs.append(GenerateRequest(f"r{i}", prompt, params))
    return reqs


def outputs(name: str, reqs, drafts_from=None, **config):
    """Per request ([(token id, logprob)], [finish reason]); the engine; each verify step's (drafts, accepted).
    drafts_from: a spec-off run's outputs, drafted from (30% of the tokens wrong) instead of prompt lookup."""
    engine = engine_for(name, **config)
    verified = []
    if drafts_from is not None:
        reference = {(r.request_id, 0): list(r.prompt_token_ids) + [t for t, _ in toks]
                     for r, (toks, _) in zip(reqs, drafts_from)}
        engine.speculator.proposer = ScriptedProposer(reference, 0.3, loaded(name).config.vocab_size)
    if engine.speculator is not None:
        record = engine.speculator.record

        def spy(steps, sampled, running):
            tokens = iter(sampled)
            verified.extend((s.num_drafts, len(t.accepted)) for s in steps
                            if (t := next(tokens) if s.sample else None) is not None and s.num_drafts)
            return record(steps, sampled, running)
        engine.speculator.record = spy
    streams = [submit(engine, r) for r in reqs]
    run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    assert engine.scheduler.state_slots.num_used == 0
    got = [([(e.token_id, e.logprob) for e in sorted(ev, key=index_of) if isinstance(e, Token)],
            [e.reason for e in ev if isinstance(e, Finished)]) for ev in streams]
    return got, engine, verified


def assert_every_verify_outcome(verified) -> None:
    """Verify steps that accepted none of their drafts, some, and all of them (of more than one)."""
    assert any(a == 0 for _, a in verified)
    assert any(0 < a < d for d, a in verified)
    assert any(a == d > 1 for d, a in verified)


@pytest.mark.parametrize("name", MODELS)
def test_drafts_generate_what_plain_decoding_generates(name):
    """Six concurrent requests, prompts chunked (24 tokens a step), drafts from the spec-off run's continuation
    with a share corrupted."""
    reqs = requests(name, 6, seed=3)
    off, _, _ = outputs(name, reqs, max_num_batched_tokens=24)
    on, engine, verified = outputs(name, reqs, drafts_from=off, max_num_batched_tokens=24, speculative_config=NGRAM)
    assert_same(off, on)
    assert_every_verify_outcome(verified)
    assert engine.stats().num_steps < sum(len(t) for t, _ in off)


def test_ngram_generates_what_plain_decoding_generates():
    """Prompt lookup: the tiny model falls into repeats, which it drafts (accepted) and leaves (rejected)."""
    name = "qwen3_5_text"
    reqs = requests(name, 4, seed=8, max_tokens=60, sampled=False)
    off, _, _ = outputs(name, reqs, max_num_batched_tokens=32)
    on, engine, verified = outputs(name, reqs, max_num_batched_tokens=32, speculative_config=NGRAM)
    assert_same(off, on)
    c = engine.speculator.counters
    assert 10 < c.num_accepted_tokens < c.num_draft_tokens
    assert any(a == 0 for _, a in verified) and any(a == d for d, a in verified)


def test_without_the_rollback_the_outputs_differ(monkeypatch):
    """Every held draft applied, accepted or not (as if the state were not rolled back): other tokens."""
    name = "qwen3_5_text"
    reqs = requests(name, 6, seed=3)
    off, _, _ = outputs(name, reqs, max_num_batched_tokens=24)
    monkeypatch.setattr(cpu_deltanet_ops.HeldDrafts, "accepted", lambda held, seq_id, start_pos: held.inputs)
    on, _, verified = outputs(name, reqs, drafts_from=off, max_num_batched_tokens=24, speculative_config=NGRAM)
    assert any(a < d for d, a in verified)
    differ = [[t for t, _ in a] != [t for t, _ in b] for (a, _), (b, _) in zip(on, off)]
    assert sum(differ) >= len(reqs) // 2


def test_without_room_in_the_rings_the_outputs_differ(monkeypatch):
    """DeepSeek-V4's rings left at the windows' reach under speculation (and the guard that refuses such steps,
    check_drafts, off): a rejected draft's inputs overwrite rows the next windows read, and requests generate
    other tokens."""
    name = "deepseek_v4"
    reqs = requests(name, 6, seed=3)
    off, _, _ = outputs(name, reqs, max_num_batched_tokens=24)
    monkeypatch.setattr(DeepseekV4ForCausalLM, "make_room_for_drafts", lambda model, k: True)
    monkeypatch.setattr(DeepseekV4ForCausalLM, "check_drafts", lambda model, batch: None)
    on, _, verified = outputs(name, reqs, drafts_from=off, max_num_batched_tokens=24, speculative_config=NGRAM)
    assert any(a < d for d, a in verified)
    differ = [[t for t, _ in a] != [t for t, _ in b] for (a, _), (b, _) in zip(on, off)]
    assert sum(differ) >= 1


def test_preemption_and_an_abort_mid_speculation():
    """A KV pool too small for the running requests (preempted sequences recompute from zero state, their held
    drafts dropped) and slots taken again by waiting requests, then a request aborted after a few verify steps:
    the others generate what they do without speculation, and every state slot comes back."""
    name = "qwen3_5_text"
    reqs = requests(name, 5, seed=7, max_tokens=40)
    config = dict(num_kv_blocks=8, max_num_seqs=3, max_num_batched_tokens=24)
    off, _, _ = outputs(name, reqs, **config)
    on, engine, verified = outputs(name, reqs, drafts_from=off, speculative_config=NGRAM, **config)
    assert engine.scheduler.num_preemptions > 0
    assert_same(off, on)
    assert_every_verify_outcome(verified)
    engine = engine_for(name, speculative_config=NGRAM, max_num_batched_tokens=24)
    reference = {(r.request_id, 0): list(r.prompt_token_ids) + [t for t, _ in toks] for r, (toks, _) in zip(reqs, off)}
    engine.speculator.proposer = ScriptedProposer(reference, 0.3, loaded(name).config.vocab_size)
    streams = [submit(engine, r) for r in reqs]
    while sum(isinstance(e, Token) for e in streams[1]) < 4:
        engine.step()
    engine.abort("r1")
    run_until_idle(engine)
    assert [e.reason for e in streams[1] if isinstance(e, Finished)] == ["abort"]
    for i in (0, 2, 3, 4):
        assert [e.token_id for e in sorted(streams[i], key=index_of) if isinstance(e, Token)] == [t for t, _ in off[i][0]]
    assert engine.scheduler.state_slots.num_used == 0


def test_mtp_and_eagle3_are_refused_with_their_reason():
    """A folder without the line's MTP module (test_spec_mtp_qwen35.py runs one that has it), and EAGLE-3 heads
    serve Qwen3 and Llama targets only."""
    from engine.eagle3 import load_eagle3_head
    from engine.model_files import ModelLoadError
    from engine.speculative import SpeculativeConfig
    with pytest.raises(ModelLoadError, match="has no multi-token-prediction layer"):
        engine_for("qwen3_5_text", speculative_config=SpeculativeConfig("mtp", 2))
    from test_spec_eagle3 import head_path
    with pytest.raises(ValueError, match="serves qwen3 and llama targets; this model is 'qwen3_5_text'"):
        load_eagle3_head(head_path("qwen3"), loaded("qwen3_5_text").config)


def test_more_drafts_than_the_rings_hold_are_refused():
    """A DeepSeek-V4 executor built for 2 draft tokens given a verify step of 3: refused (ValueError), not run
    over ring rows the accepted windows still read."""
    from engine.batch import ModelBatch, SeqStep
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    ex = CpuExecutor(loaded("deepseek_v4"), options_of(num_kv_blocks=16, max_model_len=128, num_speculative_tokens=2))
    step = SeqStep(seq_id=0, token_ids=list(range(5, 15)), start_pos=0, block_table=[0], sample=True, state_slot=0,
                   num_drafts=3)
    with pytest.raises(ValueError, match="3 draft tokens a sequence, but the compressor rings hold room for 2"):
        ex.execute(ModelBatch.build([step]))
    ex.execute(ModelBatch.build([SeqStep(seq_id=0, token_ids=list(range(5, 15)), start_pos=0, block_table=[0],
                                         sample=True, state_slot=0, num_drafts=2)]))
