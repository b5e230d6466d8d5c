"""Chat tool calling, the request side: `tools` and `tool_choice` checked, the tools rendered through
the model's chat template, and for `required` or a named function a grammar in the model's own
tool-call format, so the call is enforced by sampling, not hoped for.

Formats (picked from the chat template): "hermes", Qwen's `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>` (one block per call, "\\n" between); "llama3_json", Llama 3's bare
`{"name": ..., "parameters": {...}}` (calls separated by "; "). server/tool_calls.py parses them back.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from server.errors import invalid, wrong_type
from server.structured import JSON_OPTIONS, Constraint, parse_constraint

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolConfig:
    """A chat request's tools: `choice` is none / auto / required / named (then `named` is the name)."""
    tools: list[dict]
    choice: str
    named: str | None = None
    parallel: bool = True
    format: str = "hermes"
    tag_tokens: bool = False    # <tool_call> / </tool_call> are tokens of the vocabulary (Qwen)

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template is given (tool_choice none: no tools at all, as if none were sent)."""
        return self.tools if self.choice != "none" else None

    @property
    def parse(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> str | None:
        """The llguidance grammar of `required` / a named function (None: the model chooses)."""
        if self.choice not in ("required", "named"):
            return None
        functions = [t["function"] for t in self.tools
                     if self.choice == "required" or t["function"]["name"] == self.named]
        args_key = "parameters" if self.format == "llama3_json" else "arguments"
        variants = [call_schema(f, args_key) for f in functions]
        schema = dict(variants[0]) if len(variants) == 1 else {"anyOf": variants}
        schema["x-guidance"] = JSON_OPTIONS
        body = json.dumps(schema, ensure_ascii=False)
        many = self.parallel and self.choice == "required"
        if self.format == "llama3_json":
            call, sep = "call: %json " + body, '"; "'
        else:                   # the tags as the model's own tokens where it has them (as literals they'd be spelled)
            open_tag, close_tag = ("<tool_call>", "</tool_call>") if self.tag_tokens else ('"<tool_call>"', '"</tool_call>"')
            call = f'call: {open_tag} "\\n" call_body "\\n" {close_tag}\ncall_body: %json {body}'
            sep = '"\\n"'
        start = f"start: call ({sep} call)*" if many else "start: call"
        from llguidance import LLMatcher
        return LLMatcher.grammar_from_lark(f"{start}\n{call}\n")


def call_schema(function: dict, args_key: str) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": function["name"]},
                           args_key: function.get("parameters") or NO_PARAMETERS},
            "required": ["name", args_key], "additionalProperties": False}


def output_constraint(body: dict, tools: ToolConfig | None) -> Constraint | None:
    """A chat request's output constraint: tool_choice required / named, or the structured output
    fields (not both)."""
    constraint = parse_constraint(body)
    grammar = tools.grammar() if tools else None
    if grammar is None:
        return constraint
    if constraint is not None:
        raise invalid(f"'{constraint.field}' cannot be combined with tool_choice {tools.choice!r}", constraint.field)
    return Constraint("tools", "tools", grammar)


def tool_format(tokenizer) -> str:
    """The model's tool-call format, read off its chat template (hermes where it shows neither)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def parse_tools(body: dict, tokenizer) -> ToolConfig | None:
    """The request's tools (None: no tools, tool_choice absent or harmless)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise wrong_type("'tools' must be a list of tool objects", "tools")
    tools = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("'tools' has two functions of the same name", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise wrong_type("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    kind, named = _choice(choice, names)
    if not tools:
        if kind in ("required", "named"):
            raise invalid(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        return None
    tag_tokens = all(_token_id(tokenizer, tag) is not None for tag in ("<tool_call>", "</tool_call>"))
    return ToolConfig(tools, kind, named, parallel, tool_format(tokenizer), tag_tokens)


def _token_id(tokenizer, text: str) -> int | None:
    try:
        return tokenizer.token_to_id(text)
    except Exception:           # a tokenizer without token_to_id
        return None


def _tool(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise invalid(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
        raise invalid(f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-'",
                      f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise wrong_type(f"'{where}.function.parameters' must be a JSON schema (an object)",
                         f"{where}.function.parameters")
    return {"type": "function", "function": fn}


def _choice(choice, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise invalid(f"'tool_choice' names function {name!r}, which is not in 'tools'", "tool_choice")
        return "named", name
    raise invalid("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", "tool_choice")


def message_extras(msg: dict, where: str) -> dict:
    """A message's tool fields for the chat template: an assistant's `tool_calls` (arguments decoded
    to objects, as templates expect), a tool result's `tool_call_id` and `name`."""
    extras = {}
    calls = msg.get("tool_calls")
    if calls is not None and msg.get("role") == "assistant":
        if not isinstance(calls, list):
            raise wrong_type(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
        extras["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(msg.get(key), str):
            extras[key] = msg[key]
    return extras


def _template_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise wrong_type(f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\": "
                         f"{{\"name\", \"arguments\"}}}}", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise invalid(f"'{where}.function.arguments' is not valid JSON", f"{where}.function.arguments") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
