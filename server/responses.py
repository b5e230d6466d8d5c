"""OpenAI response bodies and stream chunks, built from the engine's TokenEvents.

One ResponseBuilder per HTTP request: `on_event` folds each event into per-choice state and returns
the stream chunks it produces; `response()` is the non-streaming body. Choice index = prompt * n + sample.

With a reasoning parser a chat reply's thinking is split off its content (server/reasoning.py), tool calls
parsed in the content only (server/tool_calls.py).

Logprobs as OpenAI gives them: a completion's top_logprobs always hold the chosen token (up to k + 1
entries, prompt positions included); a chat token's `bytes` are the token's own bytes, also for a token
that is only part of a UTF-8 character (its `token` then spells the bytes that are no text as
backslash escapes).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.events import Finished, PromptLogprobs, Scheduled, Token, TopLogprob
from server.errors import APIError
from server.protocol import ParsedRequest
from server.reasoning import REASONING, ReasoningStream
from server.tool_calls import ToolCallStream

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

MIN_LOGPROB = -9999.0       # -inf is not valid JSON


@dataclass
class LogprobEntry:
    token_id: int
    token: str
    logprob: float | None
    top: list[TopLogprob] | None


@dataclass
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False           # first chunk (role / echo) sent
    emitted_chars: int = 0          # text streamed so far (echo included): logprobs' text_offset
    tools: ToolCallStream | None = None     # chat with tools: the text split into content and tool calls
                                            # (or a grammar-bound stream of calls, server/tool_calls.py)
    content: list[str] = field(default_factory=list)   # ... and the content part of it
    reasoning: ReasoningStream | None = None    # chat with a reasoning parser: the text split off as reasoning
    thinking: list[str] = field(default_factory=list)  # ... and the reasoning part of it


class ResponseBuilder:
    def __init__(self, parsed: ParsedRequest, request_id: str, model_name: str, created: int, tokenizer: TokenizerBase):
        self.parsed = parsed
        self.id = request_id
        self.model = model_name
        self.created = created
        self.tokenizer = tokenizer
        self.n = parsed.params.n
        self.choices = {i: ChoiceState(i) for i in range(len(parsed.prompts) * self.n)}
        for choice in self.choices.values():
            choice.tools = parsed.tools.output_stream() if parsed.tools is not None else None
            choice.reasoning = ReasoningStream(parsed.reasoning.start) if parsed.reasoning is not None else None
        self.cached_tokens = [0] * len(parsed.prompts)
        self.prompt_logprobs: dict[int, list[LogprobEntry]] = {}
        self.prompt_events: dict[int, PromptLogprobs] = {}
        self.object = "text_completion" if parsed.kind == "completion" else "chat.completion"

    # -- folding events ------------------------------------------------------------------------------
    def on_event(self, prompt_idx: int, event) -> list[dict]:
        """Fold one event in; return the stream chunks it yields (possibly none)."""
        if isinstance(event, Scheduled):
            self.cached_tokens[prompt_idx] = event.cached_tokens
            return []
        if isinstance(event, PromptLogprobs):
            self.prompt_logprobs[prompt_idx] = self._prompt_entries(event)
            self.prompt_events[prompt_idx] = event
            return []
        if isinstance(event, Token) and not self.parsed.prompt_only:
            choice = self.choices[prompt_idx * self.n + event.index]
            entry = None
            if self.parsed.logprobs is not None:
                entry = LogprobEntry(event.token_id, self._token(event.token_id), event.logprob,
                                     self._top(event.top_logprobs[: self.parsed.logprobs]))
                choice.logprobs.append(entry)
            choice.text.append(event.text)
            choice.num_tokens += 1
            return self._chunks(choice, prompt_idx, event.text, [entry] if entry else [])
        if isinstance(event, Finished):
            choice = self.choices[prompt_idx * self.n + event.index]
            if self.parsed.prompt_only and event.reason != "abort":
                choice.finish_reason, choice.stop_reason = "length", None     # max_tokens 0 reached
            else:
                choice.finish_reason, choice.stop_reason = event.reason, event.stop_reason
                choice.num_tokens = max(choice.num_tokens, event.usage.completion_tokens)
            return self._chunks(choice, prompt_idx, "", [], finish=True)
        return []

    def _prompt_entries(self, event: PromptLogprobs) -> list[LogprobEntry]:
        """Echo's entries (its top-k: `logprobs`; the engine may have computed more for prompt_logprobs)."""
        k = self.parsed.logprobs or 0
        return [LogprobEntry(t, self._token(t), lp, self._top(top[:k]) if lp is not None else None)
                for t, lp, top in zip(event.token_ids, event.logprobs, event.top_logprobs)]

    def _vllm_prompt_logprobs(self, prompt_idx: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first None) {token id: {logprob, rank, decoded_token}},
        the prompt token first with its rank, then the top-k with ranks 1..k."""
        event, k = self.prompt_events.get(prompt_idx), self.parsed.prompt_logprobs
        if event is None:
            return []
        out: list[dict | None] = [None]
        ranks = event.ranks or [None] * len(event.token_ids)
        for t, lp, top, rank in list(zip(event.token_ids, event.logprobs, event.top_logprobs, ranks))[1:]:
            position = {str(t): {"logprob": _clamp(lp), "rank": rank, "decoded_token": self.tokenizer.decode([t])}}
            for r, alt in enumerate(top[:k], 1):
                position[str(alt.token_id)] = {"logprob": _clamp(alt.logprob), "rank": r, "decoded_token": alt.token}
            out.append(position)
        return out

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.parsed.tokens_as_ids else self.tokenizer.decode([token_id])

    def _top(self, top: list[TopLogprob]) -> list[TopLogprob]:
        if not self.parsed.tokens_as_ids:
            return top
        return [TopLogprob(t.token_id, f"token_id:{t.token_id}", t.logprob) for t in top]

    # -- stream chunks -------------------------------------------------------------------------------
    def _chunks(self, choice: ChoiceState, prompt_idx: int, text: str, entries: list[LogprobEntry],
                finish: bool = False) -> list[dict]:
        chunks = self._choice_chunks(choice, prompt_idx, text, entries, finish)
        if self.parsed.continuous_usage:            # vLLM's: the choice's usage so far (the role chunk's: none)
            for chunk in chunks:
                role_only = "role" in chunk["choices"][0].get("delta", {})
                chunk["usage"] = _usage(len(self.parsed.prompts[prompt_idx]), 0 if role_only else choice.num_tokens)
        return chunks

    def _choice_chunks(self, choice: ChoiceState, prompt_idx: int, text: str, entries: list[LogprobEntry],
                       finish: bool) -> list[dict]:
        chunks = []
        if not choice.started:
            choice.started = True
            if self.parsed.kind == "chat":
                chunks.append(self._chunk(choice.index, {"role": "assistant", "content": ""}, None))
            elif self.parsed.echo:
                text = self.parsed.echo_texts[prompt_idx] + text
                entries = self.prompt_logprobs.get(prompt_idx, []) + entries
        if choice.tools is not None or choice.reasoning is not None:
            return chunks + self._split_chunks(choice, text, entries, finish)
        reason = choice.finish_reason if finish else None
        if finish and not text and not entries and self.parsed.kind == "chat":
            chunks.append(self._chunk(choice.index, {}, None, reason))
        elif self.parsed.kind == "chat":
            chunks.append(self._chunk(choice.index, {"content": text}, self._chat_logprobs(entries), reason))
        else:
            lp = (self._completion_logprobs(entries, choice.emitted_chars)
                  if self.parsed.logprobs is not None else None)
            choice.emitted_chars += len(text)
            chunks.append(self._chunk(choice.index, text, lp, reason, choice.stop_reason if finish else None))
        return chunks

    def _split_chunks(self, choice: ChoiceState, text: str, entries: list[LogprobEntry], finish: bool) -> list[dict]:
        """Chat with tools or a reasoning parser: reasoning, content and tool-call deltas (a call whole, once
        its block closes; tool calls are parsed in the content only; the step's logprobs ride on its first
        chunk); finish_reason "tool_calls" where calls were made (a named function's: "stop", as OpenAI's)."""
        deltas = []
        for kind, piece in self._pieces(choice, text, finish):
            if kind == REASONING:
                choice.thinking.append(piece)
                if self.parsed.reasoning.include:
                    deltas.append({"reasoning_content": piece, "reasoning": piece})
            else:
                deltas += choice.tools.feed(piece) if choice.tools is not None else [{"content": piece}]
        if finish and choice.tools is not None:
            deltas += choice.tools.finish()
        choice.content += [d["content"] for d in deltas if "content" in d]
        lp = self._chat_logprobs(entries) if entries else None
        if lp is not None and not deltas:
            deltas = [{}]
        chunks = [self._chunk(choice.index, d, lp if i == 0 else None) for i, d in enumerate(deltas)]
        if finish:
            if choice.tools is not None and choice.tools.calls and choice.finish_reason == "stop":
                choice.finish_reason = choice.tools.calls_finish_reason
            chunks.append(self._chunk(choice.index, {}, None, choice.finish_reason))
        return chunks

    @staticmethod
    def _pieces(choice: ChoiceState, text: str, finish: bool) -> list[tuple[str, str]]:
        if choice.reasoning is None:
            return [("content", text)] if text else []
        return choice.reasoning.feed(text) + (choice.reasoning.finish() if finish else [])

    def _chunk(self, index: int, content, logprobs, finish_reason=None, stop_reason=None) -> dict:
        if self.parsed.kind == "chat":
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        chunk = {"id": self.id, "object": self._chunk_object(), "created": self.created,
                 "model": self.model, "choices": [choice]}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk_object(self) -> str:
        return "text_completion" if self.parsed.kind == "completion" else "chat.completion.chunk"

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": self._chunk_object(), "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}

    # -- final body ----------------------------------------------------------------------------------
    def usage(self) -> dict:
        usage = _usage(sum(len(p) for p in self.parsed.prompts), sum(c.num_tokens for c in self.choices.values()))
        return {**usage, "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def response(self) -> dict:
        choices = []
        prompt_logprobs = ({i: self._vllm_prompt_logprobs(i) for i in range(len(self.parsed.prompts))}
                           if self.parsed.prompt_logprobs is not None else {})
        for i, c in sorted(self.choices.items()):
            prompt_idx = i // self.n
            if self.parsed.kind == "chat":
                choices.append({"index": i, "message": self._message(c),
                                "logprobs": self._chat_logprobs(c.logprobs),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                continue
            text, entries = "".join(c.text), c.logprobs
            if self.parsed.echo:
                text = self.parsed.echo_texts[prompt_idx] + text
                entries = self.prompt_logprobs.get(prompt_idx, []) + entries
            lp = self._completion_logprobs(entries, 0) if self.parsed.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if self.parsed.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = prompt_logprobs[prompt_idx]
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if self.parsed.kind == "chat" and self.parsed.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs[0]
        return body

    def _message(self, c: ChoiceState) -> dict:
        if c.tools is None and c.reasoning is None:
            return {"role": "assistant", "content": "".join(c.text)}
        message = {"role": "assistant", "content": "".join(c.content) or None}
        if c.reasoning is not None and self.parsed.reasoning.include:
            message["reasoning_content"] = message["reasoning"] = "".join(c.thinking) or None
        if c.tools is not None and c.tools.calls:
            message["tool_calls"] = [call.message() for call in c.tools.calls]
        return message

    def _completion_logprobs(self, entries: list[LogprobEntry], offset: int) -> dict:
        offsets, pos = [], offset
        for e in entries:
            offsets.append(pos)
            pos += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [_clamp(e.logprob) for e in entries],
                "top_logprobs": [None if e.top is None else self._top_with_chosen(e) for e in entries],
                "text_offset": offsets}

    def _top_with_chosen(self, e: LogprobEntry) -> dict[str, float]:
        top = {t.token: _clamp(t.logprob) for t in e.top}
        if e.logprob is not None and all(t.token_id != e.token_id for t in e.top):
            top[e.token] = _clamp(e.logprob)
        return top

    def _chat_logprobs(self, entries: list[LogprobEntry]) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        return {"content": [{**self._chat_token(e.token_id, e.token), "logprob": _clamp(e.logprob),
                             "top_logprobs": [{**self._chat_token(t.token_id, t.token),
                                               "logprob": _clamp(t.logprob)} for t in e.top or []]}
                            for e in entries]}

    def _chat_token(self, token_id: int, text: str) -> dict:
        """token and bytes: the token's own bytes where the tokenizer knows them."""
        raw = self.tokenizer.token_bytes(token_id)
        if raw is None:
            raw = text.encode("utf-8")
        if "\ufffd" in text and not self.parsed.tokens_as_ids:
            text = raw.decode("utf-8", "backslashreplace")
        return {"token": text, "bytes": list(raw)}


    # -- server-sent events ----------------------------------------------------------------------------
    @staticmethod
    def sse(payload: dict) -> str:
        return sse(payload)

    @staticmethod
    def sse_error(error: APIError) -> str:
        return sse(error.body())

    def sse_tail(self) -> list[str]:
        """What ends a stream: the usage chunk (stream_options.include_usage), then [DONE]."""
        return ([sse(self.usage_chunk())] if self.parsed.include_usage else []) + ["data: [DONE]\n\n"]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _clamp(logprob: float | None) -> float | None:
    return None if logprob is None else max(float(logprob), MIN_LOGPROB)
