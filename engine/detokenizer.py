"""Incremental detokenization with stop strings.

Text deltas never split a multi-byte character: a window of recent tokens is decoded and
held back while it ends in U+FFFD (an incomplete UTF-8 sequence). The concatenated deltas
equal decode(all output tokens) — `finish` emits whatever a window missed. Stop strings are
matched on the text, across token boundaries; text that could still grow into a stop string
is held back, and the stop string and everything after it are never emitted.

Stop strings are found by one Aho-Corasick automaton per stop list (`stop_matcher`, cached):
each new character costs amortized O(1) whatever the number and length of the stop strings.
The first stop string to be completed wins (the longest, if several end on the same character).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class StopMatcher:
    """Aho-Corasick automaton over stop strings. A state is a node of the trie of the stop strings:
    the longest suffix of the text fed so far that starts some stop string (its length: `depth`)."""
    children: tuple[dict[str, int], ...]
    fail: tuple[int, ...]           # the state of the longest proper suffix of a state's string
    depth: tuple[int, ...]
    completed: tuple[str | None, ...]   # the longest stop string that ends at the state, if any

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.children[state]:
            state = self.fail[state]
        return self.children[state].get(ch, 0)


@lru_cache(maxsize=256)
def _compile(stops: tuple[str, ...]) -> StopMatcher:
    children: list[dict[str, int]] = [{}]
    depth, own = [0], [None]
    for s in stops:
        state = 0
        for ch in s:
            nxt = children[state].get(ch)
            if nxt is None:
                nxt = children[state][ch] = len(children)
                children.append({})
                depth.append(depth[state] + 1)
                own.append(None)
            state = nxt
        own[state] = s
    fail, completed = [0] * len(children), list(own)
    queue = deque(children[0].values())
    while queue:                    # breadth first: a state's fail link is shallower than it
        state = queue.popleft()
        for ch, nxt in children[state].items():
            f = fail[state]
            while f and ch not in children[f]:
                f = fail[f]
            fail[nxt] = children[f].get(ch, 0)
            completed[nxt] = own[nxt] or completed[fail[nxt]]
            queue.append(nxt)
    return StopMatcher(tuple(children), tuple(fail), tuple(depth), tuple(completed))


def stop_matcher(stop: list[str] | None) -> StopMatcher | None:
    """The (cached) automaton of a stop list; None when it has no non-empty string. The server
    calls this while it parses a request, so the engine thread finds the automaton built."""
    stops = tuple(s for s in (stop or []) if s)
    return _compile(stops) if stops else None


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, stop: list[str] | None = None):
        self.decode = decode
        self.matcher = stop_matcher(stop)
        self.ids: list[int] = []
        self.text = ""               # decoded so far (the concatenation of window deltas)
        self.emitted = 0             # chars of self.text already returned
        self._checked = 0            # chars of self.text already fed to the stop matcher
        self._state = 0              # the stop matcher's state after text[:_checked]
        self.stopped_on: str | None = None
        self._prefix = 0             # window start: tokens before it never change the text
        self._read = 0               # tokens already turned into text
        self._before = ""            # decode(ids[_prefix:_read]); changes only when the window moves

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, str | None]:
        """Feed one token; returns (text delta safe to emit, the stop string if one matched).
        check_stop=False (before min_tokens) releases text without matching stop strings."""
        if self.stopped_on is not None:
            return "", self.stopped_on
        ids = self.ids
        ids.append(token_id)
        before = self._before
        window = self.decode(ids[self._prefix:])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.text += window[len(before):]
            self._prefix, self._read = self._read, len(ids)
            self._before = self.decode(ids[self._prefix:self._read])
        return self._release(final=not check_stop, check_stop=check_stop)

    def finish(self) -> str:
        """Flush at the end of the sequence: the rest of the text (up to any stop string)."""
        if self.stopped_on is None:
            full = self.decode(self.ids)
            if full.startswith(self.text):
                self.text = full
            self._read = len(self.ids)
            self._before = self.decode(self.ids[self._prefix:])
        delta, _ = self._release(final=True)
        return delta

    def _release(self, final: bool, check_stop: bool = True) -> tuple[str, str | None]:
        if self.stopped_on is not None:
            return "", self.stopped_on
        end = len(self.text)
        if self.matcher is not None:
            # only a match that ends in text not fed before counts (text released unchecked
            # before min_tokens must not stop the sequence later)
            hit = self._feed(check_stop)
            if hit is not None:
                at = hit - len(self.stopped_on)
                delta = self.text[self.emitted:at]
                self.text = self.text[:at]
                self.emitted = at
                return delta, self.stopped_on
            if check_stop and not final:       # hold back what could still become a stop string
                end = max(self.emitted, end - self.matcher.depth[self._state])
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta, None

    def _feed(self, check_stop: bool) -> int | None:
        """Advance the matcher over the new text; the end of the first stop string completed in
        it (and `stopped_on` set), or None."""
        matcher, state, text = self.matcher, self._state, self.text
        for i in range(self._checked, len(text)):
            state = matcher.step(state, text[i])
            if check_stop and matcher.completed[state] is not None:
                self.stopped_on = matcher.completed[state]
                self._state, self._checked = state, i + 1
                return i + 1
        self._state, self._checked = state, len(text)
        return None
