"""EAGLE-3 draft heads (--speculative-config method "eagle3") on the numpy executor: tiny random heads in the
public layout (harness/eagle3_heads.py) load for Qwen3 and Llama targets and are refused, with the reason, where
they do not fit; the drafts the engine proposes, step after step (catch-up over verified tokens, scratch KV of
rejected drafts overwritten), equal a torch reference of the head written from the definition
(tests/eagle3_reference.py); and with the head drafting, every request generates exactly what it generates
without speculation — concurrent requests, chunked prefill, preemption, prefix hits, aborts."""
from __future__ import annotations

import functools
import os
import re

import pytest
from eagle3_reference import Eagle3Reference
from fake_executor import run_until_idle, submit
from test_handle_models import engine_for
from test_spec_engine import assert_same, repetitive_requests
from test_spec_scheduler import ScriptedProposer

from engine.eagle3 import load_eagle3_head
from engine.events import Finished, Token
from engine.model_config import ModelConfig
from engine.model_files import ModelLoadError
from engine.request import GenerateRequest, SamplingParams
from engine.speculative import SpeculativeConfig
from harness.eagle3_heads import write_random_eagle3
from harness.models import _tmp_root, build_tiny_model, tiny_model_path

# name -> (target, head writer options): GQA heads, a draft vocabulary with d2t, the head's own embedding,
# "model."-prefixed names, norm_before_residual in vLLM speculators' config form, a 6-layer target with the default
# aux layers (2, 3, 3)
HEADS = {
    "qwen3": ("qwen3_tied", dict(aux_layers=[0, 1, 1], draft_vocab=32000)),
    "qwen3_draft_vocab": ("qwen3_untied", dict(aux_layers=[1, 0, 1], draft_vocab=3000, ship_embed=True,
                                               hidden=48, prefix="model.")),
    "llama": ("llama", dict(aux_layers=[1, 1, 0], norm_before_residual=True, heads=2, kv_heads=1, head_dim=32,
                            speculators=True)),
    "llama_default_layers": ("llama6", dict(draft_vocab=5000)),
}


@functools.cache
def target_path(name: str) -> str:
    if name == "llama6":
        return build_tiny_model("llama", os.path.join(_tmp_root(), "llama6"), seed=2, num_hidden_layers=6)
    return tiny_model_path(name)


@functools.cache
def head_path(name: str) -> str:
    target, options = HEADS[name]
    return write_random_eagle3(target_path(target), os.path.join(_tmp_root(), f"eagle3_{name}"), seed=7, **options)


def eagle3(name: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("eagle3", k, model=head_path(name))


def eagle3_engine(name: str, **config):
    from fake_executor import make_engine

    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    model = load_model(target_path(HEADS[name][0]))
    ex = CpuExecutor(model, options_of(num_kv_blocks=config.pop("num_kv_blocks", 64), max_model_len=512))
    return make_engine(ex, model.tokenizer, max_model_len=512, speculative_config=eagle3(name), **config)


class Recording:
    """Wraps the head's proposer: records every proposal with the sequence's tokens and computed count then;
    steer: a proposer whose drafts go to verification instead (so some are accepted: a random head's never are),
    the head still run each step."""

    def __init__(self, proposer, steer=None):
        self.proposer, self.steer, self.calls = proposer, steer, []

    def propose(self, seqs, limits):
        drafts = self.proposer.propose(seqs, limits)
        self.calls += [(list(s.token_ids), s.num_computed, d) for s, d in zip(seqs, drafts)]
        return drafts if self.steer is None else self.steer.propose(seqs, limits)


def run_eagle3(name, reqs, speculation: bool = True, waves: int = 1, steer_from=None, **config):
    """run_drafting on an engine with the head `name` drafting."""
    return run_drafting(eagle3_engine(name, **config), reqs, speculation, waves, steer_from)


def run_drafting(engine, reqs, speculation: bool = True, waves: int = 1, steer_from=None):
    """Per request [(token id, logprob)] and finish reasons; the engine. waves: the prompts sent again after the
    first wave (prefix hits); steer_from: a spec-off run's outputs, drafted from (30% of the tokens wrong) while
    the draft runs alongside (Recording)."""
    if not speculation:
        engine.speculator = None
    elif steer_from is not None:
        reference = {(f"{r.request_id}-{w}", 0): list(r.prompt_token_ids) + [t for t, _ in toks]
                     for w in range(waves) for r, (toks, _) in zip(reqs, steer_from)}
        vocab = engine.executor.vocab_size
        engine.speculator.proposer = Recording(engine.speculator.proposer, ScriptedProposer(reference, 0.3, vocab))
    streams = []
    for wave in range(waves):
        streams += [submit(engine, GenerateRequest(f"{r.request_id}-{wave}", r.prompt_token_ids, r.params))
                    for r in reqs]
        run_until_idle(engine)
    engine.block_manager.check_invariants(idle=True)
    got = [([(e.token_id, e.logprob) for e in ev if isinstance(e, Token)],
            [e.reason for e in ev if isinstance(e, Finished)]) for ev in streams]
    return got, engine


@pytest.mark.parametrize("name", list(HEADS))
def test_drafts_equal_the_torch_reference(name):
    """Greedy requests run together in chunks, the verified drafts steered so some are accepted (the head catches
    up over several verified positions, past rejected rows); each proposal the head made equals the reference's
    drafts after the same tokens (a near tie, margin < 1e-3, may go either way)."""
    reqs = [GenerateRequest(f"r{i}", list(range(100 + 40 * i, 100 + 40 * i + 9 + 5 * i)),
                            SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)) for i in range(3)]
    off, _ = run_eagle3(name, reqs, speculation=False, max_num_batched_tokens=16)
    on, engine = run_eagle3(name, reqs, steer_from=off, max_num_batched_tokens=16)
    assert_same(off, on)
    c, stats = engine.speculator.counters, engine.stats()          # vLLM's spec_decode_* metrics, as for ngram
    assert c.num_accepted_tokens >= 5
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens) == (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)
    assert_drafts_match(engine.speculator.proposer.calls, Eagle3Reference(head_path(name), target_path(HEADS[name][0])))


def assert_drafts_match(calls, reference) -> None:
    """Every other recorded proposal equals the reference's drafts after the same tokens, up to the first that
    differs where that one is a near tie (margin < 1e-3)."""
    assert len(calls) >= 10
    for tokens, computed, drafts in calls[::2]:
        want, margins = reference.drafts(tokens, computed, len(drafts))
        for j, (got, ref) in enumerate(zip(drafts, want)):
            assert got == ref or margins[j] < 1e-3, (tokens, computed, drafts, want)
            if got != ref:
                break


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "llama_default_layers"])
def test_eagle3_generates_what_plain_decoding_generates(name):
    """Greedy and seeded sampled requests together, in chunks: the head's own drafts, and steered ones."""
    reqs = repetitive_requests("qwen3_tied", 6, seed=4)
    off, _ = run_eagle3(name, reqs, speculation=False, max_num_batched_tokens=24)
    on, engine = run_eagle3(name, reqs, max_num_batched_tokens=24)
    assert_same(off, on)
    assert engine.speculator.counters.num_draft_tokens > 100
    steered, engine = run_eagle3(name, reqs, steer_from=off, max_num_batched_tokens=24)
    assert_same(off, steered)
    c = engine.speculator.counters
    assert c.num_draft_tokens > c.num_accepted_tokens > 20


@pytest.mark.slow
def test_preemption_prefix_hits_and_aborts():
    reqs = repetitive_requests("qwen3_tied", 5, seed=5, max_tokens=32)
    check_preemption_prefix_hits_and_aborts(lambda **config: eagle3_engine("qwen3", **config), reqs, num_kv_blocks=14)


def check_preemption_prefix_hits_and_aborts(make, reqs, num_kv_blocks: int):
    """Two waves in a small KV pool (preemption, then prefix hits), steered drafts: outputs as with speculation
    off; an abort mid-decode leaves the other requests unchanged and drops the aborted one's draft state.
    make(**config): an engine with the draft attached."""
    config = dict(num_kv_blocks=num_kv_blocks, max_num_seqs=6, max_num_batched_tokens=24)
    off, _ = run_drafting(make(**config), reqs, speculation=False, waves=2)
    on, engine = run_drafting(make(**config), reqs, waves=2, steer_from=off[:len(reqs)])
    assert engine.scheduler.num_preemptions > 0 and engine.stats().prefix_cache_hits > 0
    assert engine.speculator.counters.num_accepted_tokens > 20
    assert_same(off, on)
    engine = make()
    streams = [submit(engine, GenerateRequest(f"a{r.request_id}", r.prompt_token_ids, r.params)) for r in reqs[:3]]
    for _ in range(4):
        engine.step()
    engine.abort("ar1")
    run_until_idle(engine)
    assert [e.reason for e in streams[1] if isinstance(e, Finished)] == ["abort"]
    for i in (0, 2):
        assert [e.token_id for e in streams[i] if isinstance(e, Token)] == [t for t, _ in off[i][0]]
    assert not engine.speculator.draft_states.states
    return engine


def _refusal(target: str, **options) -> str:
    folder = write_random_eagle3(target_path(target), os.path.join(_tmp_root(), "eagle3_bad"), **options)
    with pytest.raises(ValueError) as e:
        load_eagle3_head(folder, ModelConfig.from_file(target_path(target)))
    return str(e.value)


def test_heads_that_do_not_fit_are_refused():
    assert "aux hidden state layers [0, 1, 2]" in _refusal("qwen3_tied", aux_layers=[0, 1, 2])
    assert "aux hidden state layers [2, 1, -1]" in _refusal("qwen3_tied")        # vLLM's default needs 3+ layers
    with pytest.raises(ModelLoadError, match="does not fit the head's hidden size 48"):
        load_eagle3_head(write_random_eagle3(target_path("qwen3_tied"), os.path.join(_tmp_root(), "e3h"), hidden=48,
                                             aux_layers=[0, 0, 1]), ModelConfig.from_file(target_path("qwen3_tied")))
    wrong = write_random_eagle3(target_path("qwen3_tied"), os.path.join(_tmp_root(), "e3w"), aux_layers=[0, 0, 1])
    with pytest.raises(ModelLoadError, match="head is for a target of vocab"):
        load_eagle3_head(wrong, _other_vocab_target())
    from engine.loader.safetensors_io import SafetensorsCheckpoint, save_safetensors
    ckpt = SafetensorsCheckpoint(wrong)
    tensors = {n: ckpt.get(n) for n in ckpt.keys()}
    target = ModelConfig.from_file(target_path("qwen3_tied"))
    for change, message in ((lambda t: t.pop("fc.weight"), "missing fc.weight"),
                            (lambda t: t.update({"midlayer.self_attn.q_norm.weight": t["norm.weight"]}),
                             "q_norm.weight' is not part"),
                            (lambda t: t.update({"fc.weight": t["fc.weight"][:, :128]}),
                             re.escape("shape [64, 128], the layout"))):
        bad = dict(tensors)
        change(bad)
        save_safetensors(os.path.join(wrong, "model.safetensors"), bad)
        with pytest.raises(ModelLoadError, match=message):
            load_eagle3_head(wrong, target)
    with pytest.raises(ValueError, match="serves qwen3 and llama targets; this model is 'qwen3_moe'"):
        load_eagle3_head(wrong, ModelConfig.from_file(tiny_model_path("qwen3_moe")))
    with pytest.raises(ModelLoadError, match="is not a folder"):
        load_eagle3_head(os.path.join(wrong, "nope"), target)


def _other_vocab_target() -> ModelConfig:
    cfg = ModelConfig.from_file(target_path("qwen3_tied"))
    cfg.vocab_size += 1
    return cfg


def test_speculative_config_and_executor_checks():
    with pytest.raises(ValueError, match="'eagle3' needs \"model\""):
        SpeculativeConfig.from_json('{"method": "eagle3", "num_speculative_tokens": 3}')
    config = SpeculativeConfig.from_json(f'{{"method": "eagle3", "num_speculative_tokens": 3, '
                                         f'"model": "{head_path("qwen3")}"}}')
    assert config.model == head_path("qwen3")
    with pytest.raises(ValueError, match="serves qwen3 and llama targets; this model is 'qwen3_moe'"):
        engine_for("qwen3_moe", speculative_config=config)
    from engine.executor.base import ExecutorBase
    from engine.speculative import check_speculation

    class VerifiesOnly(ExecutorBase):
        supports_draft_verify = True
    with pytest.raises(ValueError, match="VerifiesOnly does not run EAGLE-3 heads"):
        check_speculation(config, VerifiesOnly())
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    tp = EngineConfig(model=target_path("qwen3_tied"), device="cpu", max_model_len=128, progress=False,
                      tensor_parallel_size=2, speculative_config=config)
    with pytest.raises(ValueError, match="TensorParallelExecutor does not run EAGLE-3 heads"):
        EngineHandle(tp)
