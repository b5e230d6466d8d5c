"""The model registry is the one list of served model types: config validation, LoRA and tensor-parallel
support, the CLI help and the oracle gates all read it, and every line it names has a transformers oracle."""
from __future__ import annotations

import pytest

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderLM
from engine.models.registry import MODEL_REGISTRY, model_class, supported_model_types


def oracle_model_types() -> set[str]:
    """The model_type of every tiny oracle model of harness/ (transformers' config classes say it)."""
    from harness.hybrid_models import HYBRID_MODELS, hf_config
    from harness.models import DSV3_MODELS, DSV4_MODELS, SPARSE_MODELS, TINY_MODELS, tiny_model_type
    types = {tiny_model_type(name) for name in {**TINY_MODELS, **SPARSE_MODELS, **DSV3_MODELS, **DSV4_MODELS}}
    return types | {hf_config(composite, text, 256, 1, 2).model_type for composite, text in HYBRID_MODELS.values()}


def test_every_registered_line_resolves_to_a_model_line():
    for model_type in supported_model_types():
        line = model_class(model_type)
        assert issubclass(line, DecoderLM) and line.model_type in MODEL_REGISTRY, model_type


def test_every_registered_line_has_a_transformers_oracle_model():
    """A line (a class; Kimi-K2 shares DeepSeek-V3's) is gated against transformers under one of its names."""
    covered = oracle_model_types()
    for line in {model_class(t) for t in MODEL_REGISTRY}:
        names = {t for t in MODEL_REGISTRY if model_class(t) is line}
        assert names & covered, f"{line.__name__} ({', '.join(sorted(names))}) has no tiny oracle model in harness/"


@pytest.mark.parametrize("model_type", ["gemma", None, ["qwen3"], 3])
def test_an_unsupported_model_type_is_refused_naming_every_registered_one(model_type):
    with pytest.raises(ValueError, match=f"unsupported model_type {model_type!r}".replace("[", r"\[")) as e:
        ModelConfig.from_dict({"model_type": model_type, "hidden_size": 64})
    assert str(e.value).endswith("supported: " + ", ".join(MODEL_REGISTRY))


def test_lora_and_tensor_parallel_support_are_what_the_lines_declare():
    from engine.lora import lora_model_types
    from engine.parallel.sharding import SUPPORTED_TYPES
    assert set(lora_model_types()) == {t for t in MODEL_REGISTRY if model_class(t).lora} >= {"qwen3", "llama", "qwen2"}
    assert set(SUPPORTED_TYPES) == {t for t in MODEL_REGISTRY if model_class(t).tensor_parallel} >= {"qwen3_moe"}


def test_the_cli_help_names_every_registered_model_type():
    from server.cli import build_parser
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    model = next(a for a in serve._actions if "--model" in a.option_strings)
    assert f"model_type {', '.join(MODEL_REGISTRY)})" in model.help, model.help
