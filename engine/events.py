"""TokenEvents: what the engine streams back for each request, in order.

Every request ends with exactly one Finished, Error or Rejected. With n > 1, `index`
says which of the n samples an event belongs to; Finished comes once per sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class Scheduled:
    request_id: str
    cached_tokens: int


@dataclass
class Token:
    request_id: str
    token_id: int
    text: str                                   # text delta (never splits a UTF-8 character)
    index: int = 0                              # which of the n samples
    logprob: float | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """For echo and prompt_logprobs: one entry per prompt token (the first is None: nothing predicts it)."""
    request_id: str
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[TopLogprob]]
    ranks: list[int | None] = field(default_factory=list)   # each token's rank in its distribution (1: likeliest)


@dataclass
class Finished:
    request_id: str
    reason: str                                 # "stop" | "length" | "abort"
    usage: Usage
    index: int = 0
    stop_reason: str | int | None = None        # the stop string or token id that matched


@dataclass
class Error:
    request_id: str
    message: str


@dataclass
class Rejected:
    request_id: str
    reason: str


TokenEvent = Scheduled | Token | PromptLogprobs | Finished | Error | Rejected
TERMINAL_EVENTS = (Finished, Error, Rejected)
