"""Structured output in the engine: grammars compiled once per text, one matcher per sequence that
advances with each accepted token, and the token bitmasks sampling applies (int32 words, bit t % 32 of
word t // 32 set: token t allowed).

The grammar engine is llguidance: a Rust core in one CPython ABI3 wheel with no dependencies (no
torch), JSON schemas, regexes and Lark grammars (with inline JSON schemas and special tokens, which
tool calls need), and a numpy API that fills a batch's bitmask rows in its own threads with the GIL
released. A grammar arrives as llguidance's grammar text (server/structured.py builds it from the
request); `GrammarCache` compiles it against the model's tokenizer once, and each sequence gets a copy
of the compiled matcher.
"""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import numpy as np

CACHE_SIZE = 256                # compiled grammars kept (by grammar text)


class GrammarError(ValueError):
    """A grammar that does not compile (the message names the problem)."""


def parser_limits():
    """llguidance's per-grammar work limits (its defaults: lexer fuel, Earley items per step, lexer
    states, grammar size): a compile or a mask step that would exceed them fails instead of stalling
    the engine; errors without the parser-state dump."""
    from llguidance import LLParserLimits
    return LLParserLimits(verbose_errors=False)


@functools.lru_cache(maxsize=8)
def llg_tokenizer(tokenizer, n_vocab: int | None, eos: tuple[int, ...]):
    """The llguidance tokenizer of an engine Tokenizer (its `tokenizers` backend), built once (~1-2 s
    for a 152K vocabulary). n_vocab: the model's logit rows, where more than the tokenizer's."""
    from llguidance import LLTokenizer
    backend = getattr(tokenizer, "tok", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise GrammarError("structured output needs a Hugging Face `tokenizers` tokenizer")
    size = backend.get_vocab_size(with_added_tokens=True)
    return LLTokenizer(backend.to_str(), n_vocab=n_vocab if n_vocab and n_vocab > size else None,
                       eos_token=list(eos) or None)


class GrammarMatcher:
    """One sequence's grammar state: `accept` each sampled token; `done` once the grammar admits
    nothing more (the sequence ends there); `error` when it broke (a token it refused, a step over
    its limits)."""
    __slots__ = ("m", "words")

    def __init__(self, matcher, words: int):
        self.m, self.words = matcher, words

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(int(token)))

    def fork(self) -> "GrammarMatcher":
        return GrammarMatcher(self.m.deep_copy(), self.words)

    @property
    def done(self) -> bool:
        return bool(self.m.is_stopped())

    @property
    def error(self) -> str | None:
        return self.m.get_error() or None if self.m.is_error() else None


class GrammarCache:
    """Compiled grammars by text (LRU, errors too) for one tokenizer; thread-safe (the server
    compiles in worker threads, the engine on its own)."""

    def __init__(self, tokenizer, vocab_size: int | None, eos_token_ids: list[int], capacity: int = CACHE_SIZE):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self.capacity = capacity
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def llt(self):
        return llg_tokenizer(self.tokenizer, self.vocab_size, self.eos)

    def compile(self, grammar: str):
        """The compiled matcher of `grammar` (not to be advanced: `matcher` copies it), or GrammarError."""
        with self._lock:
            hit = self._compiled.get(grammar)
            if hit is not None:
                self._compiled.move_to_end(grammar)
        if hit is None:
            hit = self._build(grammar)
            with self._lock:
                self._compiled[grammar] = hit
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _build(self, grammar: str):
        from llguidance import LLMatcher
        self.compiles += 1
        llt = self.llt()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, llt, limits=parser_limits())
        if is_error:
            return GrammarError(_first_line(messages[0]) if messages else "invalid grammar")
        matcher = LLMatcher(llt, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            return GrammarError(_first_line(matcher.get_error()))
        return matcher

    def check(self, grammar: str) -> str | None:
        """Why `grammar` does not compile, or None."""
        try:
            self.compile(grammar)
        except GrammarError as e:
            return str(e)
        return None

    def matcher(self, grammar: str) -> GrammarMatcher:
        compiled = self.compile(grammar)
        return GrammarMatcher(compiled.deep_copy(), (self.llt().vocab_size + 31) // 32)


def _first_line(message: str) -> str:
    """llguidance's message without its parser-state dump."""
    return message.split("\n<state>")[0].strip()


@functools.lru_cache(maxsize=1)
def _executor():
    from llguidance import LLExecutor
    return LLExecutor()


def fill_bitmask(matchers: list[GrammarMatcher], out: np.ndarray) -> None:
    """out[i] = the next-token bitmask of matchers[i], computed in llguidance's threads (GIL released).
    out: C-contiguous int32 [>= len(matchers), matchers' words]."""
    if not matchers:
        return
    from llguidance.numpy import fill_next_token_bitmask_par
    fill_next_token_bitmask_par(_executor(), [(g.m, i) for i, g in enumerate(matchers)], out)


def step_bitmask(grammars: list) -> tuple[list[int], np.ndarray | None]:
    """(rows that have a grammar, their bitmask rows in that order) for one step's sampled rows
    (grammars[i]: row i's GrammarMatcher or None)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return rows, None
    out = np.empty((len(rows), grammars[rows[0]].words), np.int32)
    fill_bitmask([grammars[i] for i in rows], out)
    return rows, out


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [vocab]: the tokens one bitmask row allows (ids past the mask's words: none)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")
    out = np.zeros(vocab, bool)
    n = min(vocab, bits.size)
    out[:n] = bits[:n].astype(bool)
    return out


def only_stop_tokens(allowed: np.ndarray, stop_ids: list[int]) -> bool:
    """Whether the grammar allows nothing but stop tokens (then min_tokens yields to it)."""
    rest = allowed.copy()
    ids = [t for t in stop_ids if 0 <= t < rest.size]
    rest[ids] = False
    return not rest.any()
