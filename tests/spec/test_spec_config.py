"""--speculative-config: vLLM's JSON parsed and checked at start (defaults, aliases, the per-batch-size schedule),
and refused with a clear message where the method, the executor or the model line cannot serve it."""
from __future__ import annotations

import subprocess

import pytest

from engine.speculative import SpeculativeConfig, check_speculation


def parse(**raw) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict(raw)


def test_ngram_defaults_and_vllm_spellings():
    c = parse(method="ngram", num_speculative_tokens=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)           # vLLM's defaults
    assert (parse(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4).prompt_lookup_min,
            parse(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2).prompt_lookup_max) == (4, 2)
    assert parse(model="ngram", num_speculative_tokens=2).method == "ngram"     # vLLM infers the method
    assert parse(method="[ngram]", num_speculative_tokens=2).method == "ngram"
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
                                       '"prompt_lookup_max": 3}') == SpeculativeConfig("ngram", 4, 1, 3)


@pytest.mark.parametrize("raw,needle", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is not a speculative decoding method"),
    ({"num_speculative_tokens": 2}, "method is required"),
    ({"method": "eagle3", "model": "/m", "num_speculative_tokens": 2}, "the folder of an EAGLE-3 draft head"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "got None"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 1, "model": "/d"}, "'mtp' drafts with the served model"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer in [1, 32], got None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/some/draft"}, "takes no draft model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]},
     "start at batch size 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [3, 8, 0]]},
     "not overlap"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 1, 9, 2]]},
     "5-item form"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]},
     "k >= 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": 3}, "list of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "8"}, "disable_by_batch_size must be"),
])
def test_bad_configs_are_refused_naming_why(raw, needle):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(raw)
    assert needle in str(e.value)


@pytest.mark.parametrize("text", ["not json", "[1, 2]"])
def test_bad_json_is_refused(text):
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.from_json(text)


def test_the_batch_size_schedule_follows_vllms_lookup():
    """Inclusive ranges; a gap takes the entry before it, sizes past the last entry its k; k at most
    num_speculative_tokens; no schedule: always num_speculative_tokens; none from disable_by_batch_size on."""
    c = parse(method="ngram", num_speculative_tokens=4,
              num_speculative_tokens_per_batch_size=[[1, 2, 6], [3, 4, 2], [8, 16, 0]])
    assert [c.tokens_for_batch(b) for b in (1, 2, 3, 4, 5, 7, 8, 16, 17, 500)] == [4, 4, 2, 2, 2, 2, 0, 0, 0, 0]
    assert parse(method="ngram", num_speculative_tokens=3).tokens_for_batch(1000) == 3
    off = parse(method="ngram", num_speculative_tokens=3, disable_by_batch_size=4,       # vLLM: off from 4 running
                num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 8, 1]])
    assert [off.tokens_for_batch(b) for b in (1, 2, 3, 4, 9)] == [3, 3, 1, 0, 0]


class _Executor:
    supports_draft_verify = True
    num_state_slots = 0
    rolls_back_state = False
    families = frozenset()

    def rank0(self):
        return self

    @property
    def model(self):
        return type("Line", (), {"op_families": self.families})()


def test_an_executor_or_line_that_cannot_verify_is_refused():
    config = parse(method="ngram", num_speculative_tokens=2)
    check_speculation(config, _Executor())
    no_verify = type("GpuLike", (_Executor,), {"supports_draft_verify": False})()
    with pytest.raises(ValueError, match="GpuLike does not verify draft tokens yet"):
        check_speculation(config, no_verify)
    deltanet = {"num_state_slots": 8, "families": frozenset({"deltanet"})}
    with pytest.raises(ValueError, match="Gated DeltaNet .* which GpuLike does not roll back .* one-GPU executor do"):
        check_speculation(config, type("GpuLike", (_Executor,), deltanet)())
    check_speculation(config, type("NumpyLike", (_Executor,), {**deltanet, "rolls_back_state": True})())
    rings = type("Dsv4", (_Executor,), {"num_state_slots": 8, "families": frozenset({"moe", "dsv4"})})()
    with pytest.raises(ValueError, match="DeepSeek-V4 keeps compressor rings .* Dsv4 does not size them for "
                                         "drafts yet; the numpy executor and the one-GPU executor do"):
        check_speculation(config, rings)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_gpu_tensor_parallel_is_refused_before_the_model_loads(device, monkeypatch):
    """--speculative-config with the GPU (named, or "auto" finding one) over tensor-parallel ranks is refused at
    start, before the model is read (a verify step's rows sample on rank 0 alone); one GPU takes it."""
    from engine import loader
    from engine.config import EngineConfig
    from engine.executor import factory
    from engine.handle import EngineHandle
    from engine.speculative import check_device
    monkeypatch.setattr(factory, "gpu_available", lambda: True)
    monkeypatch.setattr(loader, "load_model", lambda path: pytest.fail("the model was loaded"))
    spec = parse(method="ngram", num_speculative_tokens=2)
    config = EngineConfig(model="/nonexistent", device=device, speculative_config=spec, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 speculative decoding is not served yet"):
        EngineHandle(config)
    check_device(spec, "cuda")
    check_device(spec, "cpu", tensor_parallel_size=2)


def test_the_gpu_executor_verifies_and_its_tensor_parallel_ranks_do_not():
    from engine.executor.gpu import GpuExecutor
    from engine.parallel.gpu_ops import GpuRankExecutor
    assert GpuExecutor.supports_draft_verify and not GpuRankExecutor.supports_draft_verify


def test_engine_config_validates_it():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="speculative_config: num_speculative_tokens"):
        EngineConfig(speculative_config=SpeculativeConfig("ngram", 0)).validate()


def test_which_executors_roll_back_state():
    """The numpy executor rolls Qwen3.5's DeltaNet state back (tests/spec/test_spec_state.py) and, built for
    drafts, sizes DeepSeek-V4's compressor rings so that rejected drafts overwrite nothing read; built without
    drafts (no verify steps) it does neither for the rings; the GPU executor does neither."""
    from engine.executor.cpu import CpuExecutor
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from harness.hybrid_models import hybrid_model_path
    from harness.models import tiny_model_path
    assert not GpuExecutor.rolls_back_state
    options = options_of(num_kv_blocks=16, max_model_len=128)
    qwen35 = CpuExecutor(load_model(hybrid_model_path("qwen3_5_text")), options)
    assert qwen35.num_state_slots and qwen35.rolls_back_state
    dsv4 = CpuExecutor(load_model(tiny_model_path("deepseek_v4")), options)
    assert dsv4.num_state_slots and not dsv4.rolls_back_state
    with pytest.raises(ValueError, match="DeepSeek-V4 keeps compressor rings"):
        check_speculation(parse(method="ngram", num_speculative_tokens=2), dsv4)
    model = load_model(tiny_model_path("deepseek_v4"))
    rings = {s.ring: s.ring_len for s in model.model.attention_specs if s.rate}
    dsv4 = CpuExecutor(model, options_of(num_kv_blocks=16, max_model_len=128, num_speculative_tokens=3))
    assert dsv4.rolls_back_state
    assert {s.ring: s.ring_len for s in model.model.attention_specs if s.rate} == {r: n + 3 for r, n in rings.items()}
    assert {n: a.shape[2] for n, a in dsv4.ops.dsv4.state.items()} == {r: n + 3 for r, n in rings.items()}


def test_cli_flag_parses_and_refuses_with_a_clear_message(capsys):
    from server.cli import build_parser, engine_config, main
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'])
    assert engine_config(args).speculative_config == SpeculativeConfig("ngram", 3, 2, 2)
    gen = build_parser().parse_args(["generate", "hi", "--speculative-config",
                                     '{"model": "ngram", "num_speculative_tokens": 1}'])
    assert engine_config(gen).speculative_config.method == "ngram"
    with pytest.raises(SystemExit):
        main(["serve", "--speculative-config", '{"method": "eagle3", "model": "x", "num_speculative_tokens": 2}'])
    assert "--speculative-config: method 'eagle3' needs \"model\": the folder of an EAGLE-3 draft head" in \
        capsys.readouterr().err


def test_generate_with_speculation_prints_what_it_prints_without():
    from test_server_cli import OPENINFER, ROOT

    from harness.models import tiny_model_path
    argv = OPENINFER + ["generate", "one two one two one two", "--model", tiny_model_path("qwen3_tied"), "--device",
                        "cpu", "--max-tokens", "12", "--no-chat"]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']
    runs = [subprocess.run(argv + extra, cwd=ROOT, capture_output=True, text=True, timeout=180) for extra in ([], spec)]
    assert all(run.returncode == 0 for run in runs), runs[1].stderr
    assert runs[0].stdout == runs[1].stdout and "finish_reason=" in runs[1].stderr
