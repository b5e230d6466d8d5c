"""Stop strings by automaton: the same answers as a brute-force search over the text, at a cost per
new character that does not grow with the number of stop strings."""
import random
import time

from engine.detokenizer import IncrementalDetokenizer, StopMatcher, stop_matcher
from fake_executor import FakeTokenizer


def brute_force(text: str, stops: list[str]) -> tuple[str, str | None]:
    """(the text before the stop, the stop): the first stop string to be completed, the longest of
    those completed on the same character."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[:end - len(s)], s
    return text, None


def run(stops: list[str], text: str) -> tuple[str, str | None]:
    t = FakeTokenizer()
    d = IncrementalDetokenizer(t.decode, stops)
    out = ""
    for token in t.encode(text):
        delta, hit = d.add(token)
        out += delta
        if hit:
            return out, hit
    return out + d.finish(), None


def test_random_stop_lists_agree_with_brute_force():
    rng = random.Random(3)
    for _ in range(400):
        alphabet = "abc" if rng.random() < 0.7 else "ab é"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        assert run(stops, text) == brute_force(text, stops), (stops, text)


def test_held_back_text_is_exactly_the_longest_stop_prefix():
    t = FakeTokenizer()
    d = IncrementalDetokenizer(t.decode, ["abcd", "bcx", "cz"])
    assert d.add(ord("a")) == ("", None)          # "a" may become "abcd"
    assert d.add(ord("b")) == ("", None)          # "ab"
    assert d.add(ord("c")) == ("", None)          # "abc"
    assert d.add(ord("q")) == ("abcq", None)      # no stop string starts with any suffix of "abcq"
    assert d.add(ord("c")) == ("", None)          # "c" may become "cz"
    assert d.add(ord("z")) == ("", "cz")


def test_one_automaton_per_stop_list_is_shared():
    a, b = stop_matcher(["x", "yz"]), stop_matcher(["x", "yz"])
    assert isinstance(a, StopMatcher) and a is b
    assert stop_matcher([]) is None and stop_matcher([""]) is None


def test_cost_per_character_does_not_grow_with_the_stop_list(monkeypatch):
    rng = random.Random(5)
    many = ["".join(rng.choice("abcdefgh") for _ in range(12)) + str(i) for i in range(5000)]
    text = "".join(rng.choice("abcdefgh ") for _ in range(3000))
    stop_matcher(many)                              # built once (the server does this off the engine thread)
    steps = {"n": 0}
    step = StopMatcher.step

    def counted(self, state, ch):
        steps["n"] += 1
        return step(self, state, ch)
    monkeypatch.setattr(StopMatcher, "step", counted)
    assert run(many, text) == (text, None)
    assert steps["n"] == len(text)                  # one automaton step per new character
    monkeypatch.setattr(StopMatcher, "step", step)

    def seconds(stops):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            run(stops, text)
            best = min(best, time.perf_counter() - t0)
        return best
    # 5,000 stop strings cost about what one does (a search per stop string per token: ~1000x)
    assert seconds(many) < 4 * seconds(many[:1])
