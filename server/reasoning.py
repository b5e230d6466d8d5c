"""Reasoning output, vLLM's `--reasoning-parser`: a model's thinking, written between <think> and </think>,
is split off its answer into `reasoning_content` (and `reasoning`, vLLM's newer name for it), never into
`content` nor tool-call parsing. `ReasoningStream.feed(text)` splits streamed text exactly at the tags,
holding back what may be the start of a tag split across tokens; a whole output is the same stream fed
at once, so streamed and whole replies agree.

Where the output starts is read off the end of the rendered prompt: a template that opens the block
(`<think>`: DeepSeek-R1, Qwen3-Thinking, Qwen3.5) starts it in reasoning; one that closes it (Qwen3's
`enable_thinking: false` renders an empty `<think>\\n\\n</think>`) in content. Otherwise "qwen3" leaves it to
the model (content until it opens `<think>`) and "deepseek_r1" starts in reasoning (R1 may omit the opening
tag). A request with an output grammar (structured output, tool_choice required) starts where the model
opens `<think>` too, as "qwen3": the grammar writes the answer from the first token. After the block ends
the rest is content, tags included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.tool_calls import partial_suffix

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
REASONING, OPEN, CONTENT = "reasoning", "open", "content"     # OPEN: content, until the model opens a block
PROMPT_TAIL_TOKENS = 32         # the prompt's last tokens, decoded, show whether its template opened a block


def check_reasoning_parser(name: str | None, tokenizer: TokenizerBase) -> None:
    """Refuse (ValueError, at start) a parser this server does not have, or a model with no think tags."""
    if name is None:
        return
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    if not tokenizer.has_marker_tokens(OPEN_TAG, CLOSE_TAG):
        raise ValueError(f"--reasoning-parser {name}: the model's vocabulary has no {OPEN_TAG} / {CLOSE_TAG} "
                         "tokens, so it does not write reasoning blocks")


@dataclass
class Reasoning:
    """A chat request's reasoning split: the mode its output starts in; include: reasoning is sent
    (vLLM's `include_reasoning`)."""
    start: str
    include: bool = True


def request_reasoning(parser: str | None, tokenizer: TokenizerBase, prompt, constrained: bool,
                      include: bool) -> Reasoning | None:
    """The split of a chat request's output (None: no reasoning parser), from the end of its prompt ids."""
    if parser is None:
        return None
    tail = tokenizer.decode([int(t) for t in prompt[-PROMPT_TAIL_TOKENS:]]).rstrip()
    if tail.endswith(CLOSE_TAG):
        start = CONTENT
    elif constrained or (parser == "qwen3" and not tail.endswith(OPEN_TAG)):
        start = OPEN
    else:
        start = REASONING
    return Reasoning(start, include)


class ReasoningStream:
    """One output's text split into ("reasoning" | "content", text) pieces, in order."""

    def __init__(self, start: str):
        self.mode = start
        self.opened = False     # an opening tag was seen (only the first is a tag; the block does not nest)
        self.buffer = ""        # text held back: it may be the start of a tag
        self.tokens = 0         # output tokens that were reasoning (usage's reasoning_tokens)

    def feed(self, text: str) -> list[tuple[str, str]]:
        started_in, out = self.mode, []
        self.buffer += text
        while self.buffer:
            tags = self._tags()
            found = [(self.buffer.find(t), t) for t in tags if t in self.buffer]
            if found:
                at, tag = min(found)
                self._emit(self.buffer[:at], out)
                self.buffer = self.buffer[at + len(tag):]
                self.opened = True
                self.mode = REASONING if tag == OPEN_TAG else CONTENT
                continue
            keep = max((partial_suffix(self.buffer, t) for t in tags), default=0)
            self._emit(self.buffer[:len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        if started_in == REASONING and text != OPEN_TAG and (self.mode == REASONING or any(
                kind == REASONING for kind, _ in out)):
            self.tokens += 1
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The end of the output: text held back is what it looked like."""
        out: list[tuple[str, str]] = []
        self._emit(self.buffer, out)
        self.buffer = ""
        return out

    def _tags(self) -> list[str]:
        if self.mode == CONTENT:
            return []
        return [CLOSE_TAG] if self.opened else [OPEN_TAG, CLOSE_TAG]

    def _emit(self, text: str, out: list[tuple[str, str]]) -> None:
        if not text:
            return
        kind = REASONING if self.mode == REASONING else CONTENT
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

