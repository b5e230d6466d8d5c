"""Stop strings around min_tokens: text released before min_tokens (unchecked) must not trigger a
stop later, whatever the lengths of the other stop strings."""
from engine.detokenizer import IncrementalDetokenizer
from fake_executor import FakeTokenizer


def test_stop_string_released_before_min_tokens_does_not_stop_later():
    t = FakeTokenizer()
    d = IncrementalDetokenizer(t.decode, ["\n", "User:"])
    out = ""
    for ch in "hi\n":                                   # before min_tokens: released, not matched
        delta, hit = d.add(ord(ch), check_stop=False)
        assert hit is None
        out += delta
    for ch in "ok":                                     # after: only new text may match
        delta, hit = d.add(ord(ch))
        assert hit is None, f"stopped on {hit!r} released before min_tokens"
        out += delta
    assert out == "hi\nok"
    delta, hit = d.add(ord("\n"))                       # a new stop string still stops
    assert hit == "\n" and out + delta == "hi\nok"
