"""Long texts tokenized in parts (engine/text_pieces.py) give exactly the ids of one encode: the real Qwen
tokenizer on adversarial texts (random token soup, newline / space / punctuation / digit / CJK / combining
mark / special-token mixtures, word lists), with and without the post-processor's specials, and a
Llama-3-style BOS prefix; tokenizers whose pieces are not known are never cut."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.text_pieces import MIN_CHARS, cut, known_pieces, splitter
from engine.tokenizer import Tokenizer
from harness.models import qwen_tokenizer_dir

tokenizers = pytest.importorskip("tokenizers")
QWEN = qwen_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN is None, reason="the real Qwen tokenizer is not here")
SOUP = list("abcdefghij XYZ  \n\n\t.,!?'’éü中文日本語0123456789") + [
    "\u0301", "\r\n", " \n", "\n ", "'s", "<|im_start|>", "<|endoftext|>", "  ", "\n\n\n"]


def qwen():
    return tokenizers.Tokenizer.from_file(f"{QWEN}/tokenizer.json")


def texts(hf, rng, n):
    for i in range(n):
        if i % 3 == 0:
            yield hf.decode(rng.integers(0, 150000, int(rng.integers(3000, 9000))).tolist())
        elif i % 3 == 1:
            yield "".join(rng.choice(SOUP, int(rng.integers(MIN_CHARS, 40000))))
        else:
            words = ["".join(rng.choice(list("abcdefghijklmnop"), int(rng.integers(1, 9)))) for _ in range(6000)]
            seps = rng.choice([" ", " ", " ", "\n", ". ", ", ", "  ", "\n\n", " 12 "], len(words))
            yield "".join(w + s for w, s in zip(words, seps))


@needs_qwen
def test_cut_texts_encode_to_the_same_ids():
    hf = qwen()
    tok = Tokenizer(hf)
    assert tok._splitter is not None
    tok._splitter.max_parts = 8                         # whatever this machine's cores
    rng = np.random.default_rng(0)
    cuts = 0
    for text in texts(hf, rng, 30):
        parts = cut(text)
        assert "".join(parts) == text
        cuts += len(parts) > 1
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special).ids
    assert cuts >= 25                                   # the texts were in fact cut


@needs_qwen
def test_a_bos_prefix_is_put_in_front_once():
    spec = json.loads(qwen().to_str())
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643],
                                                                    "tokens": ["<|endoftext|>"]}}}
    hf = tokenizers.Tokenizer.from_str(json.dumps(spec))
    tok = Tokenizer(hf)
    tok._splitter.max_parts = 8
    text = next(texts(hf, np.random.default_rng(1), 1))
    assert hf.encode(text).ids[0] == 151643 and len(cut(text)) > 1
    assert tok.encode(text) == hf.encode(text).ids
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False).ids


@needs_qwen
def test_unknown_pieces_are_never_cut():
    spec = json.loads(qwen().to_str())
    assert known_pieces(spec)
    variants = []
    gpt2 = dict(spec, pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                     "use_regex": True})
    variants.append(gpt2)                                # GPT-2's regex: a cut after newlines is not a boundary
    other = json.loads(json.dumps(spec))
    other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    variants.append(other)
    prefix_space = json.loads(json.dumps(spec))
    prefix_space["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    variants.append(prefix_space)
    lowercase = dict(spec, normalizer={"type": "Lowercase"})
    variants.append(lowercase)
    spaced = json.loads(json.dumps(spec))
    spaced["added_tokens"].append(dict(spaced["added_tokens"][0], id=151700, content="<a b>"))
    variants.append(spaced)
    stripping = json.loads(json.dumps(spec))
    stripping["added_tokens"][0]["rstrip"] = True
    variants.append(stripping)
    for v in variants:
        assert not known_pieces(v)
        assert splitter(tokenizers.Tokenizer.from_str(json.dumps(v))) is None


def test_a_text_without_boundaries_stays_whole():
    assert cut("x" * 50_000) == ["x" * 50_000]
    text = ("word " * 4000).strip()
    parts = cut(text, piece_chars=1000)
    assert "".join(parts) == text and len(parts) > 5 and all(p.startswith(" ") for p in parts[1:])
