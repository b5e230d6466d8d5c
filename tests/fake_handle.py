"""A scripted engine for the HTTP layer's tests, defined from first principles: a byte tokenizer and a
'model' that replays the prompt backwards, so every expected value is computed, not stored."""
from __future__ import annotations

import asyncio
import random

from engine.config import EngineConfig
from engine.engine_calls import EngineCalls
from engine.grammar import GrammarCache
from engine.events import Error, Finished, PromptLogprobs, Rejected, Scheduled, Token, TopLogprob, Usage
from engine.stats import EngineStats
from engine.tokenizer import TokenizerBase

EOS = 0


class ByteTokenizer(TokenizerBase):
    """One token per UTF-8 byte (ids 1..256 = byte + 1); id 0 is EOS."""
    vocab_size = 257
    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def fake_token(prompt: list[int], step: int, sample: int) -> int:
    """The fake model: sample k replays the prompt backwards, shifted by k."""
    return prompt[-1 - (step + sample) % len(prompt)]


def fake_logprob(token: int) -> float:
    return -((token % 7) + 1) / 4


class FakeHandle(EngineCalls):
    model_name = "fake-model"
    max_model_len = 256
    max_n = 16

    def __init__(self, token_delay: float = 0.0, reject: str | None = None, fail: str | None = None):
        self.config = EngineConfig()
        self.tokenizer = ByteTokenizer()
        self.token_delay = token_delay
        self.reject, self.fail = reject, fail
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.submitted = []

    async def submit(self, req):
        self.submitted.append(req)
        if self.reject:
            yield Rejected(req.request_id, self.reject)
            return
        self.active.add(req.request_id)
        p = req.params
        try:
            yield Scheduled(req.request_id, cached_tokens=0)
            if self.fail:
                yield Error(req.request_id, self.fail)
                return
            prompt = [int(t) for t in req.prompt_token_ids]   # a list or the server's int32 array, like the engine
            if p.prompt_logprobs is not None:
                ids = prompt
                yield PromptLogprobs(req.request_id, ids, [None] + [fake_logprob(t) for t in ids[1:]],
                                     [[]] + [self._top(t, p.prompt_logprobs) for t in ids[1:]])
            for step in range(p.max_tokens):
                for k in range(p.n):
                    if req.request_id not in self.active:
                        yield Finished(req.request_id, "abort", Usage(len(prompt), step), k)
                        return
                    tok = fake_token(prompt, step, k)
                    top = self._top(tok, p.logprobs) if p.logprobs is not None else []
                    yield Token(req.request_id, tok, self.tokenizer.decode([tok]), k,
                                fake_logprob(tok) if p.logprobs is not None else None, top)
                await asyncio.sleep(self.token_delay)
            for k in range(p.n):
                yield Finished(req.request_id, "length", Usage(len(prompt), p.max_tokens), k)
        finally:
            self.active.discard(req.request_id)

    def _top(self, tok: int, k: int) -> list[TopLogprob]:
        alts = [tok] + [t for t in (tok + 1, tok + 2, tok + 3) if t < 257]
        return [TopLogprob(t, self.tokenizer.decode([t]), fake_logprob(t)) for t in alts[:k]]

    def is_healthy(self) -> bool:
        return True

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.discard(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.active), kv_blocks_used=len(self.active) * 2, kv_blocks_total=100)

    async def check_grammar(self, grammar: str) -> None:
        """The engine's check, on a real grammar cache of the byte tokenizer (which cannot do it)."""
        GrammarCache(self.tokenizer, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids).compile(grammar)


class ScriptedHandle(FakeHandle):
    """The fake engine whose 'model' writes `script` (ASCII) and stops, 1 to 3 bytes per token (a tag of
    the text is split across tokens as a real tokenizer may split it)."""
    script = ""

    async def submit(self, req):
        self.submitted.append(req)
        yield Scheduled(req.request_id, 0)
        rng, data, at, n = random.Random(self.script), self.script.encode(), 0, 0
        while at < len(data):
            k = rng.randint(1, 3)
            yield Token(req.request_id, data[at] + 1, data[at:at + k].decode(), 0)
            at, n = at + k, n + 1
        yield Finished(req.request_id, "stop", Usage(len(req.prompt_token_ids), n))


def expected_text(prompt: str, n_tokens: int, sample: int = 0) -> str:
    ids = ByteTokenizer().encode(prompt)
    return ByteTokenizer().decode([fake_token(ids, s, sample) for s in range(n_tokens)])
