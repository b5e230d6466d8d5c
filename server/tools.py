"""Chat tool calling, the request side: `tools` and `tool_choice` checked, the tools rendered through
the model's chat template, and for `required` or a named function a JSON schema grammar, so the call is
enforced by sampling, not hoped for, and ends when it is complete (vLLM's forms):

- `required`: a JSON array of calls `[{"name": ..., "parameters": {...}}, ...]` (an anyOf over the tools;
  one item at most where parallel_tool_calls is false);
- a named function: its arguments object alone (the tool's parameters schema).

Every object of these schemas that lists its `properties` and leaves `additionalProperties` open is
closed (as xgrammar's strict mode does in vLLM): a model may not pad a call with keys the tool does not
take. With tool_choice `auto` the model writes calls in its own format, read off the chat template:
"hermes", Qwen's `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; "llama3_json", Llama
3's bare `{"name": ..., "parameters": {...}}`. server/tool_calls.py parses each form back.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.errors import invalid, wrong_type
from server.structured import Constraint, json_grammar, parse_constraint
from server.tool_calls import CallArrayStream, NamedCallStream, ToolCallStream

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
NO_PARAMETERS = {"type": "object", "properties": {}}
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


@dataclass
class ToolConfig:
    """A chat request's tools: `choice` is none / auto / required / named (then `named` is the name)."""
    tools: list[dict]
    choice: str
    named: str | None = None
    parallel: bool = True
    format: str = "hermes"

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template is given (tool_choice none: no tools at all, as if none were sent)."""
        return self.tools if self.choice != "none" else None

    @property
    def parse(self) -> bool:
        return self.choice != "none"

    def output_stream(self):
        """The parser of one choice's output (server/tool_calls.py)."""
        if self.choice == "required":
            return CallArrayStream()
        if self.choice == "named":
            return NamedCallStream(self.named)
        return ToolCallStream(self.format)

    def schema(self) -> dict | None:
        """The JSON schema of `required` / a named function (None: the model chooses)."""
        params = {t["function"]["name"]: closed(t["function"].get("parameters") or NO_PARAMETERS)
                  for t in self.tools}
        if self.choice == "named":
            return params[self.named]
        if self.choice != "required":
            return None
        defs = {}
        for p in params.values():           # a tool's "#/$defs/..." references name the document's root
            for key in ("$defs", "definitions"):
                for name, sub in p.pop(key, {}).items():
                    if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                        raise invalid(f"'tools' define {key} '{name}' twice, differently", "tools")
        item = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": p},
             "required": ["name", "parameters"], "additionalProperties": False} for name, p in params.items()]}
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}), "items": item, **defs}

    def grammar(self) -> str | None:
        """The llguidance grammar of `required` / a named function (None: the model chooses)."""
        schema = self.schema()
        return None if schema is None else json_grammar(schema, "tools")


def closed(schema):
    """A copy of a JSON schema whose objects with listed `properties` admit no other keys (where the
    schema leaves that open); objects combined by `allOf` stay open (a branch sees only its own keys)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and not any(
            k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")):
        out["additionalProperties"] = False
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = [closed(v) for v in out[key]] if isinstance(out[key], list) else closed(out[key])
    return out


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


def tool_format(tokenizer: TokenizerBase) -> str:
    """The model's tool-call format, read off its chat template (hermes where it shows neither)."""
    template = tokenizer.chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def parse_tools(body: dict, tokenizer: TokenizerBase) -> ToolConfig | None:
    """The request's tools (None: no tools, tool_choice absent or harmless)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise wrong_type("'tools' must be a list of tool objects", "tools")
    tools = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("'tools' has two functions of the same name", "tools")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel         # null: the default, as OpenAI's schema allows
    if not isinstance(parallel, bool):
        raise wrong_type("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    kind, named = _choice(choice, names)
    if not tools:
        if kind in ("required", "named"):
            raise invalid(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        return None
    return ToolConfig(tools, kind, named, parallel, tool_format(tokenizer))


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
    if not isinstance(fn.get("description", ""), (str, type(None))):
        raise wrong_type(f"'{where}.function.description' must be a string", f"{where}.function.description")
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
