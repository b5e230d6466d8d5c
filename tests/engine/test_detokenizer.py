"""Incremental detokenization: deltas never split a character and concatenate to the full
decode; stop strings match across token boundaries and never reach the output."""
import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from fake_executor import FakeTokenizer


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import Tokenizer
    from harness.models import tokenizer_source
    return Tokenizer.from_folder(tokenizer_source()[0])


def stream(decode, ids, stop=None):
    d = IncrementalDetokenizer(decode, stop)
    deltas = []
    for t in ids:
        delta, hit = d.add(t)
        deltas.append(delta)
        if hit:
            return deltas, hit
    deltas.append(d.finish())
    return deltas, None


TEXTS = ["héllo wörld, naïve café", "你好，世界！今日は", "emoji 🎉🚀👩‍👩‍👧 done", "€100 ≠ ¥100 — ok",
         "mixed: Ωμέγα дом 🧪 end\n\tnext line"]


@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_multibyte_deltas(tok, text):
    ids = tok.encode(text)
    deltas, _ = stream(lambda x: tok.decode(x, skip_special_tokens=True), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas), deltas


def test_real_tokenizer_random_ids_concatenate(tok):
    rng = random.Random(0)
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas, _ = stream(decode, ids)
        assert "".join(deltas) == decode(ids)


def test_split_character_waits_for_its_last_byte():
    t = FakeTokenizer()
    ids = [ord("a"), 259, 260, 257, 0xC3, 0xA9, ord("z")]     # a, € in two tokens, é, é as bytes, z
    deltas, _ = stream(t.decode, ids)
    assert deltas == ["a", "", "€", "é", "", "é", "z", ""]


def test_random_bytes_concatenate():
    t = FakeTokenizer()
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(262) for _ in range(rng.randrange(1, 30))]
        deltas, _ = stream(t.decode, ids)
        assert "".join(deltas) == t.decode(ids)


def test_stop_string_across_tokens_excluded():
    t = FakeTokenizer()
    ids = t.encode("Hello STOP world")
    deltas, hit = stream(t.decode, ids, stop=["STOP"])
    assert hit == "STOP" and "".join(deltas) == "Hello "
    # "S", "T", "O" are held back while they could still become the stop string
    assert deltas[:7] == ["H", "e", "l", "l", "o", " ", ""]


def test_stop_string_inside_multitoken_piece():
    t = FakeTokenizer()
    ids = [ord("x"), 258, ord("c"), ord("d")]                # "x" "ab" "c" "d"
    deltas, hit = stream(t.decode, ids, stop=["bc"])
    assert hit == "bc" and "".join(deltas) == "xa"


def test_near_miss_is_released():
    t = FakeTokenizer()
    deltas, hit = stream(t.decode, t.encode("STASTOXSTOP!"), stop=["STOP", "XY"])
    assert hit == "STOP" and "".join(deltas) == "STASTOX"
    deltas, hit = stream(t.decode, t.encode("abcST"), stop=["STOP"])
    assert hit is None and "".join(deltas) == "abcST"     # finish releases the held-back tail


def test_earliest_of_several_stops_wins():
    t = FakeTokenizer()
    deltas, hit = stream(t.decode, t.encode("one two three"), stop=["three", "two"])
    assert hit == "two" and "".join(deltas) == "one "


def test_check_stop_false_releases_stop_text():
    t = FakeTokenizer()
    d = IncrementalDetokenizer(t.decode, ["ab"])
    assert d.add(ord("a"), check_stop=False) == ("a", None)
    assert d.add(ord("b"), check_stop=False) == ("b", None)
    assert d.add(ord("a")) == ("", None)
    assert d.add(ord("b")) == ("", "ab")
    assert d.text == "ab"


def test_skip_special_tokens():
    t = FakeTokenizer()
    deltas, _ = stream(lambda x: t.decode(x, skip_special_tokens=True), [ord("a"), 256, ord("b")])
    assert "".join(deltas) == "ab"
    deltas, _ = stream(lambda x: t.decode(x, skip_special_tokens=False), [ord("a"), 256])
    assert "".join(deltas) == "a</s>"
