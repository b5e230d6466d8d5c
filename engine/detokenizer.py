"""Incremental detokenization with stop strings.

Text deltas never split a multi-byte character: a window of recent tokens is decoded and
held back while it ends in U+FFFD (an incomplete UTF-8 sequence). The concatenated deltas
equal decode(all output tokens) — `finish` emits whatever a window missed. Stop strings are
matched on the text, across token boundaries; text that could still grow into a stop string
is held back, and the stop string and everything after it are never emitted.
"""
from __future__ import annotations

from typing import Callable

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, stop: list[str] | None = None):
        self.decode = decode
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""               # decoded so far (the concatenation of window deltas)
        self.emitted = 0             # chars of self.text already returned
        self._checked = 0            # chars of self.text already searched for (or released past) stops
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
        end, checked = len(self.text), self._checked
        self._checked = end
        if self.stop and check_stop:
            # only a match that ends in text not searched before counts (text released unchecked
            # before min_tokens must not stop the sequence later)
            hits = [(self.text.find(s, max(0, checked - len(s) + 1)), s) for s in self.stop]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, s = min(hits)
                self.stopped_on = s
                delta = self.text[self.emitted:at]
                self.text = self.text[:at]
                self.emitted = at
                return delta, s
            if not final:
                end -= self._partial_stop_suffix()
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta, None

    def _partial_stop_suffix(self) -> int:
        """Length of the longest suffix of the unreleased text that starts some stop string."""
        tail = self.text[self.emitted:]
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best
