"""The OpenAI Responses API, the reply side: the chat builder's deltas (reasoning, content, whole tool
calls) become output items — a reasoning item, a message with one output_text part, function_call items —
and, streamed, the typed event sequence, each event numbered (`sequence_number`):

    response.created, response.in_progress,
    per item: response.output_item.added, (message, reasoning) response.content_part.added,
      response.output_text.delta / response.reasoning_text.delta ..., their .done, response.content_part.done,
      (function_call) response.function_call_arguments.delta, .done, then response.output_item.done,
    response.completed (response.incomplete where max_output_tokens ended it).

A non-streamed reply is the same items, whole: the events are built and dropped.
"""
from __future__ import annotations

import copy
import json
import uuid
from typing import TYPE_CHECKING

from server.errors import APIError
from server.protocol import ParsedRequest
from server.responses import ResponseBuilder

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

TEXT_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
TEXT_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


class ResponsesBuilder:
    """One /v1/responses reply (the app's builder interface: on_event, response, sse, sse_error, sse_tail)."""

    def __init__(self, parsed: ParsedRequest, request_id: str, model_name: str, created: int, tokenizer: TokenizerBase):
        self.chat = ResponseBuilder(parsed, request_id, model_name, created, tokenizer)
        self.parsed = parsed
        self.id = "resp_" + request_id.rsplit("-", 1)[-1]
        self.model, self.created = model_name, created
        self.output: list[dict] = []            # the items; the last one may still be open
        self.open: dict | None = None           # the message or reasoning item taking text deltas
        self.sequence = 0
        self.status, self.incomplete = "in_progress", None

    def on_event(self, prompt_idx: int, event) -> list[dict]:
        events = []
        if self.sequence == 0:
            events += [self._event("response.created", response=copy.deepcopy(self.response())),
                       self._event("response.in_progress", response=copy.deepcopy(self.response()))]
        for chunk in self.chat.on_event(prompt_idx, event):
            choice = chunk["choices"][0]
            delta, logprobs = choice["delta"], choice["logprobs"]
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"], [])
            if delta.get("content"):
                events += self._text("message", delta["content"], (logprobs or {}).get("content") or [])
            for call in delta.get("tool_calls", []):
                events += self._call(call["id"], call["function"]["name"], call["function"]["arguments"])
            if choice["finish_reason"] is not None:
                events += self._finish(choice["finish_reason"])
        return events

    def response(self) -> dict:
        """The response object (its usage once it has ended)."""
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
               "background": False, "error": None, "incomplete_details": self.incomplete, "model": self.model,
               "output": self.output, "previous_response_id": None, "store": False, "truncation": "disabled",
               **self.parsed.request_fields, "usage": None}
        if self.status != "in_progress":
            usage, choice = self.chat.usage(), self.chat.choices[0]
            reasoning = choice.reasoning.tokens if choice.reasoning is not None else 0
            out["usage"] = {"input_tokens": usage["prompt_tokens"],
                            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                                     "cache_write_tokens": 0},
                            "output_tokens": usage["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": reasoning},
                            "total_tokens": usage["total_tokens"]}
        return out

    # -- items ---------------------------------------------------------------------------------------
    def _text(self, kind: str, text: str, logprobs: list[dict]) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed") + self._open(kind)
        item, index = self.open, len(self.output) - 1
        part = item["content"][0]
        part["text"] += text
        extra = {}
        if kind == "message":
            part["logprobs"] += logprobs
            extra["logprobs"] = logprobs
        return events + [self._event(TEXT_DELTA[kind], item_id=item["id"], output_index=index, content_index=0,
                                     delta=text, **extra)]

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self.open, index = item, len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item)),
                  self._event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=copy.deepcopy(part))]
        item["content"].append(part)
        return events

    def _close(self, status: str) -> list[dict]:
        """End the open message or reasoning item: its text's .done, content_part.done, output_item.done."""
        item, index = self.open, len(self.output) - 1
        if item is None:
            return []
        self.open = None
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
        item["status"] = status
        return [self._event(TEXT_DONE[item["type"]], **where, text=part["text"], **extra),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        """A function call, whole: its item added, its arguments in one delta, done."""
        events = self._close("completed")
        item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events += [self._event("response.output_item.added", output_index=where["output_index"],
                               item=copy.deepcopy(item)),
                   self._event("response.function_call_arguments.delta", **where, delta=arguments)]
        item.update(arguments=arguments, status="completed")
        return events + [self._event("response.function_call_arguments.done", **where, name=name, arguments=arguments),
                         self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _finish(self, reason: str) -> list[dict]:
        """The end: completed, or incomplete (max_output_tokens reached, or the request aborted)."""
        ended = "completed" if reason in ("stop", "tool_calls") else "incomplete"
        events = self._close(ended)
        self.status = ended
        if reason == "length":
            self.incomplete = {"reason": "max_output_tokens"}
        return events + [self._event(f"response.{ended}", response=self.response())]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    # -- server-sent events --------------------------------------------------------------------------
    @staticmethod
    def sse(payload: dict) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def sse_error(self, error: APIError) -> str:
        return self.sse(self._event("error", code=error.code, message=error.message, param=error.param))

    @staticmethod
    def sse_tail() -> list[str]:
        return []


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
