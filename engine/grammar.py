"""Structured output in the engine: grammars compiled and checked once per text, one matcher per
sequence that advances with each accepted token, and the token bitmasks sampling applies (int32 words,
bit t % 32 of word t // 32 set: token t allowed).

The grammar engine is llguidance: a Rust core in one CPython ABI3 wheel with no dependencies (no
torch), JSON schemas, regexes and Lark grammars (with inline JSON schemas and special tokens, which
tool calls need), and a numpy API that fills a batch's bitmask rows in its own threads with the GIL
released. A grammar arrives as llguidance's grammar text (server/structured.py builds it from the
request). `GrammarCache` is the one owner of compiled grammars: the server's check (an engine op,
engine/engine_calls.py) and the engine's admission use the same entry, so a new grammar is compiled
once.

llguidance builds its lexer lazily, under per-step work limits, in state every copy of a compiled
grammar shares: a grammar that compiles can still go past those limits at its first tokens (a regex
of a million repetitions, a rule of 5,000 alternatives, a schema that recurses with no way out), and
once the shared lexer has failed every later copy fails at once. So a compile is followed by a probe
(a few seeded walks over the grammar, every token through the same mask and consume steps generation
uses); a grammar that fails either, or takes longer than CHECK_TIME_LIMIT_S, is refused, and that
answer is kept. A grammar that fails later, while generating, fails its request with the reason and is
refused from then on.
"""
from __future__ import annotations

import functools
import random
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

CACHE_SIZE = 256                # compiled grammars kept (by grammar text)
CHECK_TIME_LIMIT_S = 10.0       # a grammar whose compile and probe take longer is refused
PROBE_WALKS, PROBE_STEPS = 4, 16    # the probe: seeded walks of at most this many tokens
CHECK_THREADS = 4               # grammars compiled and probed at once (run_check)


class GrammarError(ValueError):
    """A grammar that cannot be enforced (the message names why); the server answers it with a 400."""
    status = 400


def parser_limits():
    """llguidance's per-grammar work limits (its defaults: lexer fuel, Earley items per step, lexer
    states, grammar size): a compile or a mask step that would exceed them fails instead of stalling
    the engine; errors without the parser-state dump."""
    from llguidance import LLParserLimits
    return LLParserLimits(verbose_errors=False)


@functools.lru_cache(maxsize=8)
def llg_tokenizer(tokenizer: TokenizerBase, n_vocab: int | None, eos: tuple[int, ...]):
    """The llguidance tokenizer of an engine Tokenizer (its `tokenizers` backend), built once (~1-2 s
    for a 152K vocabulary). n_vocab: the model's logit rows, where more than the tokenizer's."""
    from llguidance import LLTokenizer
    backend = tokenizer.tok
    if backend is None:
        raise GrammarError("structured output needs a Hugging Face `tokenizers` tokenizer")
    size = backend.get_vocab_size(with_added_tokens=True)
    return LLTokenizer(backend.to_str(), n_vocab=n_vocab if n_vocab and n_vocab > size else None,
                       eos_token=list(eos) or None)


class GrammarMatcher:
    """One sequence's grammar state: `accept` each sampled token (False once the matcher has failed:
    a token it refused, a step over its limits; `on_error` hears why); `done` once the grammar admits
    nothing more (the sequence ends there)."""
    __slots__ = ("m", "words", "on_error")

    def __init__(self, matcher, words: int, on_error: Callable[[str], None] | None = None):
        self.m, self.words, self.on_error = matcher, words, on_error

    def accept(self, token: int) -> bool:
        # a failed matcher still "consumes" EOS (its masks allow only EOS): the failure is is_error()
        if self.m.consume_token(int(token)) and not self.m.is_error():
            return True
        if self.on_error is not None:
            self.on_error(self.error)
        return False

    def bitmask(self) -> np.ndarray:
        """int32 [words]: the next-token bitmask of this matcher alone."""
        out = np.empty((1, self.words), np.int32)
        fill_bitmask([self], out)
        return out[0]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the grammar would accept from here (its state unchanged)."""
        return int(self.m.validate_tokens([int(t) for t in tokens]))

    def advance_draft(self, token: int) -> bool:
        """Take a draft token while its step is verified (rollback undoes it); False if refused."""
        return bool(self.m.consume_token(int(token))) and not self.m.is_error()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens tokens taken (advance_draft)."""
        if num_tokens and not self.m.rollback(int(num_tokens)):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} draft tokens")

    def fork(self) -> "GrammarMatcher":
        return GrammarMatcher(self.m.deep_copy(), self.words, self.on_error)

    @property
    def done(self) -> bool:
        return bool(self.m.is_stopped()) and not self.m.is_error()

    @property
    def error(self) -> str | None:
        return _first_line(self.m.get_error()) or "unknown error" if self.m.is_error() else None


@dataclass
class _Entry:
    """One grammar's compile: its template (never advanced: matchers copy it) or why it cannot be used."""
    ready: threading.Event = field(default_factory=threading.Event)
    template: object = None
    error: GrammarError | None = None


class GrammarCache:
    """Compiled and probed grammars by text (LRU, refusals too) for one tokenizer; thread-safe: the
    server's checks run in its worker threads (`run_check`), admission on the engine thread, and a
    grammar compiling in one is waited for by the others (one compile per text)."""

    def __init__(self, tokenizer: TokenizerBase, vocab_size: int | None, eos_token_ids: list[int],
                 capacity: int = CACHE_SIZE):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._workers: ThreadPoolExecutor | None = None
        self.compiles = 0

    def llt(self):
        return llg_tokenizer(self.tokenizer, self.vocab_size, self.eos)

    def compile(self, grammar: str):
        """The compiled template of `grammar` (not to be advanced: `matcher` copies it), or GrammarError."""
        with self._lock:
            entry = self._entries.get(grammar)
            owner = entry is None
            if owner:
                entry = self._entries[grammar] = _Entry()
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(grammar)
        if owner:
            try:
                entry.template, entry.error = self._build(grammar)
            finally:
                entry.ready.set()
        entry.ready.wait()
        template = entry.template           # before the error: `_failed` sets the error first
        if entry.error is not None:
            raise entry.error
        return template

    def cached(self, grammar: str) -> bool:
        """Whether `grammar`'s answer is known (a check then needs no worker thread)."""
        with self._lock:
            entry = self._entries.get(grammar)
        return entry is not None and entry.ready.is_set()

    def check(self, grammar: str) -> str | None:
        """Why `grammar` cannot be enforced, or None."""
        try:
            self.compile(grammar)
        except GrammarError as e:
            return str(e)
        return None

    def run_check(self, grammar: str, job: Callable[[], None]) -> None:
        """job() (which checks `grammar`) at once where the answer is known, else on one of CHECK_THREADS
        workers of this cache (made where it is used: threads do not survive a fork)."""
        if self.cached(grammar):
            job()
            return
        with self._lock:
            if self._workers is None:
                self._workers = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="openinfer-grammar")
        self._workers.submit(job)

    def matcher(self, grammar: str) -> GrammarMatcher:
        template = self.compile(grammar)
        return GrammarMatcher(template.deep_copy(), (self.llt().vocab_size + 31) // 32,
                              functools.partial(self._failed, grammar, template))

    def _failed(self, grammar: str, template, reason: str | None) -> None:
        """A matcher of `grammar` failed while generating: the grammar is refused from now on (its
        shared lexer may be spent; a fresh compile would fail the same way)."""
        error = GrammarError(f"the grammar went past the engine's limits while generating: {reason}")
        with self._lock:
            entry = self._entries.get(grammar)
            if entry is not None and entry.template is template:
                entry.error = error
                entry.template = None

    def _build(self, grammar: str) -> tuple[object, GrammarError | None]:
        """(template, None) or (None, why): compile, then probe, within CHECK_TIME_LIMIT_S."""
        from llguidance import LLMatcher
        with self._lock:
            self.compiles += 1
        start = time.monotonic()
        try:
            matcher = LLMatcher(self.llt(), grammar, log_level=0, limits=parser_limits())
            problem = _first_line(matcher.get_error()) if matcher.is_error() else probe(matcher, self.eos)
        except GrammarError as e:
            return None, e
        except Exception as e:                  # noqa: BLE001 - llguidance refusing its input: the grammar's fault
            problem = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        if problem is None and took > CHECK_TIME_LIMIT_S:
            problem = f"took longer than {CHECK_TIME_LIMIT_S:g} s to compile and check ({took:.1f} s)"
        return (None, GrammarError(problem)) if problem is not None else (matcher, None)


def probe(template, eos: tuple[int, ...]) -> str | None:
    """Why `template` fails within PROBE_WALKS seeded walks of PROBE_STEPS tokens (each step: the mask,
    then one allowed token, not EOS where another is allowed, consumed), or None. The walks run on
    copies, so what they build of the shared lexer is there for the requests."""
    rng = random.Random(0)
    for _ in range(PROBE_WALKS):
        m = template.deep_copy()
        for _step in range(PROBE_STEPS):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
            if m.is_error() or m.is_stopped():
                break
            allowed = np.flatnonzero(bits)
            if allowed.size == 0:
                return "the grammar allows no token"
            token = int(allowed[rng.randrange(allowed.size)])
            while token in eos and allowed.size > len(eos):
                token = int(allowed[rng.randrange(allowed.size)])
            if not m.consume_token(token):
                break
        if m.is_error():
            return _first_line(m.get_error())
    return None


def _first_line(message: str) -> str:
    """llguidance's message without its parser-state dump."""
    return re.split(r"\n<(?:state>|non-verbose/>)", message)[0].strip()


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
