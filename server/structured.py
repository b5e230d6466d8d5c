"""Structured output requests: the fields that constrain an output, turned into one llguidance grammar
(SamplingParams.grammar), and the check, by the engine, that it can be enforced before the request runs.

Fields (completions and chat): OpenAI's `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` (Lark, or GBNF converted to Lark) and the newer `structured_outputs`
object with the keys `json`, `regex`, `choice`, `grammar`, `json_object`. At most one constraint per
request. JSON is generated compactly (", " and ": " separators, no free whitespace: a small model
cannot loop on blank lines); a schema's own "x-guidance" options override that.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from engine.engine_calls import EngineCallError
from engine.grammar import CHECK_TIME_LIMIT_S, GrammarError
from server.errors import APIError, invalid, wrong_type
from server.schema_recursion import unsatisfiable_ref

CHECK_WAIT_S = CHECK_TIME_LIMIT_S + 5.0     # the engine's own limit decides; this only bounds the wait
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
HARMLESS_KEYS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


@dataclass
class Constraint:
    """One request's output constraint: its kind, the field it came from, the llguidance grammar."""
    kind: str                   # json | regex | choice | grammar
    field: str
    grammar: str


def parse_constraint(body: dict) -> Constraint | None:
    """The request's output constraint (None: free text); 400 / 422 naming the field otherwise."""
    found: list[tuple[str, str, object]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        found += _response_format(fmt)
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((kind, name, body[name]))
    if body.get("structured_outputs") is not None:
        found += _structured_outputs(body["structured_outputs"])
    if len(found) > 1:
        names = ", ".join(f"'{f}'" for _, f, _ in found)
        raise invalid(f"only one output constraint may be given, got {names}", found[1][1])
    if not found:
        return None
    kind, name, value = found[0]
    return Constraint(kind, name, BUILDERS[kind](value, name))


def _response_format(fmt) -> list[tuple[str, str, object]]:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise wrong_type("'response_format' must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return []
    if kind == "json_object":
        return [("json", "response_format", {"type": "object"})]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise wrong_type("'response_format.json_schema' must be an object with 'name' and 'schema'",
                             "response_format.json_schema")
        for key, kind in (("name", str), ("strict", bool)):
            if spec.get(key) is not None and not isinstance(spec[key], kind):
                raise wrong_type(f"'response_format.json_schema.{key}' must be a {kind.__name__}",
                                 f"response_format.json_schema.{key}")
        schema = spec.get("schema", {"type": "object"})
        return [("json", "response_format.json_schema.schema", schema)]
    raise invalid(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                  "response_format.type")


def _structured_outputs(value) -> list[tuple[str, str, object]]:
    if not isinstance(value, dict):
        raise wrong_type("'structured_outputs' must be an object", "structured_outputs")
    found = []
    for key, item in value.items():
        where = f"structured_outputs.{key}"
        if item is None or key in HARMLESS_KEYS:
            continue
        if key == "json_object":
            if item is True:
                found.append(("json", where, {"type": "object"}))
            elif item is not False:
                raise wrong_type(f"'{where}' must be a boolean", where)
        elif key in STRUCTURED_KEYS:
            found.append((key, where, item))
        else:
            raise invalid(f"'{where}' is not supported by this server", where)
    return found


def json_grammar(schema, name: str) -> str:
    """A JSON schema (an object, or its JSON text) as a grammar."""
    from llguidance import LLMatcher
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid(f"'{name}' is not valid JSON: {exc}", name) from None
    if not isinstance(schema, (dict, bool)):
        raise wrong_type(f"'{name}' must be a JSON schema (an object)", name)
    ref = unsatisfiable_ref(schema)
    if ref is not None:
        raise invalid(f"'{name}' is not a valid JSON schema: Unsatisfiable schema: '$ref' {ref!r} recurses with no "
                      f"way out (every value would contain another)", name)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise invalid(f"'{name}' is not a valid JSON schema: {exc}", name) from None


def regex_grammar(pattern, name: str) -> str:
    from llguidance import LLMatcher
    if not isinstance(pattern, str):
        raise wrong_type(f"'{name}' must be a string (a regular expression)", name)
    return LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices, name: str) -> str:
    """One of the given strings, exactly."""
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise wrong_type(f"'{name}' must be a non-empty list of non-empty strings", name)
    return regex_grammar("(" + "|".join(map(regex_literal, choices)) + ")", name)


def lark_grammar(text, name: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (`::=` rules), converted."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark
    if not isinstance(text, str) or not text.strip():
        raise wrong_type(f"'{name}' must be a non-empty string (a Lark or GBNF grammar)", name)
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(text))
    except Exception as exc:                  # the GBNF converter's parse errors
        raise invalid(f"'{name}' could not be read as a grammar: {exc}", name) from None


def regex_literal(text: str) -> str:
    """text as a regex matching exactly it (Rust regex syntax)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


BUILDERS = {"json": json_grammar, "regex": regex_grammar, "choice": choice_grammar, "grammar": lark_grammar}


# -- the check ---------------------------------------------------------------------------------------
async def check_grammar(grammar: str, field: str, handle) -> None:
    """400 naming `field` where the engine cannot enforce the grammar: it does not compile, fails the
    engine's probe, or takes longer than CHECK_TIME_LIMIT_S to (the engine's grammar cache decides, off
    the engine thread, and keeps the answer: the same one every time; the request then finds the compiled
    grammar there). CHECK_WAIT_S bounds the wait on an engine that does not answer."""
    try:
        await asyncio.wait_for(handle.check_grammar(grammar), CHECK_WAIT_S)
    except GrammarError as exc:
        raise invalid(f"'{field}' cannot be enforced: {exc}", field) from None
    except asyncio.TimeoutError:
        raise invalid(f"'{field}' took longer than {CHECK_WAIT_S:g} s to compile and check", field) from None
    except EngineCallError as exc:             # the engine process has ended
        raise APIError(exc.status, f"engine error: {exc}", code="engine_error") from None
