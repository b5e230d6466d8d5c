"""Chat tool calling, the response side: a model's output text split into content and tool calls, as
it streams. `ToolCallStream.feed(text)` returns the chat deltas (content, or one tool call each, sent
whole once its block closes); `finish()` flushes; `parse_output` runs the same on a whole text, so a
streamed reply and a plain one carry the same content and calls.

Content is the text outside the calls, without the blank space around them. A block that does not
parse as a call (a model free to call, tool_choice auto) stays content, as written.

A grammar-bound output (server/tools.py) has no content: `CallArrayStream` reads tool_choice required's
JSON array (each call sent as its object closes), `NamedCallStream` a named function's arguments
object. A call cut off by max_tokens is dropped (the finish_reason "length" tells).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str              # JSON text of the arguments object

    def delta(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_json(text: str, args_keys=("arguments", "parameters")) -> ToolCall | None:
    """A call from its JSON object text ({"name": ..., "arguments": {...}}), or None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return call_from_object(obj, args_keys)


def call_from_object(obj, args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):           # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallStream:
    """Splits streamed text of one choice into content and tool calls (format: hermes | llama3_json)."""
    calls_finish_reason = "tool_calls"      # the choice's finish_reason "stop" where it made calls

    def __init__(self, fmt: str = "hermes"):
        self.format = fmt
        self.calls: list[ToolCall] = []
        self.buffer = ""                # text not yet classified
        self.in_call = False            # hermes: inside a <tool_call> block
        self.held = ""                  # blank space held back: sent only if more content follows
        self.started = False            # content sent already (leading blank space is dropped)
        self.json_mode: bool | None = None   # llama3_json: the output is calls (starts with "{")

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        if self.format == "llama3_json":
            return self._feed_llama()
        out: list[dict] = []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
                self.in_call = False
                self._block(body, OPEN + body + CLOSE, out)
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                self._content(self.buffer[:start], out)
                self.buffer, self.in_call = self.buffer[start + len(OPEN):], True
                continue
            keep = partial_suffix(self.buffer, OPEN)
            self._content(self.buffer[:len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return out

    def finish(self) -> list[dict]:
        """The end of the output: an unclosed block is a call where it parses, else content."""
        out: list[dict] = []
        if self.format == "llama3_json":
            if self.json_mode:
                calls = _json_calls(self.buffer)
                if calls is None:
                    self._content(self.buffer, out)
                for call in calls or []:
                    self._add_call(call, out)
            else:
                self._content(self.buffer, out)
        elif self.in_call:
            self._block(self.buffer, OPEN + self.buffer, out)
        else:
            self._content(self.buffer, out)
        self.buffer, self.in_call = "", False
        return out

    def _feed_llama(self) -> list[dict]:
        if self.json_mode is None:
            head = self.buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []
            self.json_mode = head.startswith("{")
            self.buffer = head if self.json_mode else self.buffer
        if self.json_mode:
            return []                   # calls are read whole, at the end
        out: list[dict] = []
        self._content(self.buffer, out)
        self.buffer = ""
        return out

    def _block(self, body: str, raw: str, out: list[dict]) -> None:
        call = call_from_json(body.strip())
        if call is None:
            self._content(raw, out)
        else:
            self.held = ""              # the blank space before a call is not content
            self._add_call(call, out)

    def _add_call(self, call: ToolCall, out: list[dict]) -> None:
        out.append({"tool_calls": [call.delta(len(self.calls))]})
        self.calls.append(call)

    def _content(self, text: str, out: list[dict]) -> None:
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if not self.started:
            body = body.lstrip()
        if body:
            self.started = True
            out.append({"content": body})


class CallArrayStream:
    """tool_choice required: `[{"name": ..., "parameters": {...}}, ...]`, each call sent once its object
    closes (the grammar made the text valid JSON; a string may hold any bracket)."""
    calls_finish_reason = "tool_calls"

    def __init__(self):
        self.calls: list[ToolCall] = []
        self.item: list[str] = []           # the open item's text
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        for ch in text:
            if self.depth >= 2:
                self.item.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.item = [ch]
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    self._item_closed(out)
        return out

    def _item_closed(self, out: list[dict]) -> None:
        call = call_from_json("".join(self.item), ("parameters",))
        if call is not None:
            out.append({"tool_calls": [call.delta(len(self.calls))]})
            self.calls.append(call)

    def finish(self) -> list[dict]:
        return []


class NamedCallStream:
    """A named function's call: the output is its arguments object, sent as one call at the end."""
    calls_finish_reason = "stop"            # OpenAI's (and vLLM's) finish_reason for a forced function

    def __init__(self, name: str):
        self.name, self.text, self.calls = name, [], []

    def feed(self, text: str) -> list[dict]:
        self.text.append(text)
        return []

    def finish(self) -> list[dict]:
        try:
            args = json.loads("".join(self.text))
        except ValueError:                  # cut off by max_tokens
            return []
        call = call_from_object({"name": self.name, "arguments": args})
        if call is None:
            return []
        self.calls.append(call)
        return [{"tool_calls": [call.delta(0)]}]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back: it may be one)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _json_calls(text: str) -> list[ToolCall] | None:
    """Llama 3's calls: JSON objects separated by ';' (None: the text is not only calls)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at >= len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = call_from_object(obj)
        if call is None:
            return None
        calls.append(call)


def parse_output(text: str, fmt: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(content or None, tool calls) of a whole output."""
    stream = ToolCallStream(fmt)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    return content or None, stream.calls
