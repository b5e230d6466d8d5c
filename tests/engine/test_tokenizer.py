"""Tokenizer: round trips, agreement with transformers' tokenizer and apply_chat_template, eos ids."""
from __future__ import annotations

import os

import pytest

from engine.loader import load_model
from engine.loader.demo import demo_gguf_path, demo_model_path
from engine.tokenizer import Tokenizer, TokenizerBase
from harness.models import tiny_model_path

TEXTS = [
    "Hello, world!",
    "naïve café — Ünïcödé ß",
    "日本語のテキストと中文 and emoji 🚀🧪👩‍👩‍👧",
    "  leading spaces\n\nnew lines\ttabs  ",
    "code: def f(x):\n    return {'a': [1, 2]}",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me a joke — in 日本語"}],
]


@pytest.fixture(scope="module")
def folders():
    return {"tiny": tiny_model_path("qwen3_tied"), "demo": demo_model_path()}


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_round_trip_multibyte(folders, which):
    tok = load_model(folders[which]).tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert len(tok.encode("🚀")) >= 1 and tok.vocab_size > 1000


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_matches_transformers_tokenizer_and_chat_template(folders, which):
    from transformers import AutoTokenizer
    folder = folders[which]
    ours = Tokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == want
    special = ours.special_tokens["eos_token"]
    assert ours.encode(f"a{special}b", add_special_tokens=False) == theirs.encode(f"a{special}b",
                                                                                 add_special_tokens=False)


def test_demo_tokenizer_matches_transformers_gguf_tokenizer(folders):
    """The tokenizer built from the GGUF metadata agrees with transformers' own GGUF conversion
    (texts without digits: llama.cpp's 'smollm' pre-tokenizer splits digits one by one, which
    transformers' generic GGUF conversion does not)."""
    from transformers import AutoTokenizer
    gguf = demo_gguf_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    ours = load_model(folders["demo"]).tokenizer
    for text in [t for t in TEXTS if not any(c.isdigit() for c in t)] + ["The capital of France is"]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode("2024") == [ours.token_to_id(c) for c in "2024"]
    conv = CONVERSATIONS[1]
    assert ours.apply_chat_template(conv) == theirs.apply_chat_template(conv, tokenize=False,
                                                                        add_generation_prompt=True)


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_the_declared_parts_are_filled_at_load(folders, which):
    """What TokenizerBase declares, as a loaded tokenizer (a folder's, the GGUF conversion's) fills it,
    against transformers' tokenizer of the same folder."""
    from transformers import AutoTokenizer
    ours = load_model(folders[which]).tokenizer
    theirs = AutoTokenizer.from_pretrained(folders[which])
    assert isinstance(ours, TokenizerBase) and ours.tok is not None
    assert ours.vocab_size == len(theirs)
    assert ours.chat_template == theirs.chat_template and ours.info()["chat_template"] == theirs.chat_template
    assert theirs.eos_token_id in ours.eos_token_ids
    vocab = theirs.get_vocab()
    for markers in [("<think>", "</think>"), ("<|im_end|>",), ("<|im_start|>", "<|no such token|>")]:
        assert ours.has_marker_tokens(*markers) == all(m in vocab for m in markers), markers
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
        assert all(len(ours.token_bytes(i)) <= ours.max_token_bytes for i in ids)


def test_the_base_declares_every_part_absent():
    """A tokenizer with only encode / decode (a test's stand-in) answers each optional part as absent."""
    base = TokenizerBase()
    assert (base.vocab_size, base.chat_template, base.max_token_bytes, base.tok, base.info()) == (None,) * 5
    assert list(base.eos_token_ids) == [] and base.token_bytes(5) is None and base.has_marker_tokens("<think>")
    with pytest.raises(ValueError, match="no chat template"):
        base.apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_and_special_ids(folders):
    tiny = load_model(folders["tiny"]).tokenizer
    im_end, eot = tiny.token_to_id("<|im_end|>"), tiny.token_to_id("<|endoftext|>")
    assert tiny.eos_token_ids == [im_end, eot]             # generation_config order, tokenizer eos included
    assert tiny.eos_token_id == im_end and tiny.bos_token_id == eot
    assert tiny.convert_ids_to_tokens([im_end]) == ["<|im_end|>"] and tiny.is_special(im_end)
    assert tiny.decode([eot, tiny.encode("hi")[0]], skip_special_tokens=True) == "hi"
    demo = load_model(folders["demo"]).tokenizer
    assert demo.eos_token_ids == [demo.token_to_id("<|im_end|>")]


def test_chat_template_errors():
    tok = Tokenizer(Tokenizer.from_folder(tiny_model_path("qwen2")).tok, {}, None)
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = Tokenizer(tok.tok, {}, "{{ raise_exception('bad role') }}")
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = Tokenizer(tok.tok, {}, "{% generation %}{{ messages[0]['content'] | tojson }}{% endgeneration %}")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'
