"""The JSON body of a request, parsed and checked before any field is read: its media type (a body must
come as `Content-Type: application/json`, or a `+json` type: 415 otherwise, so that no page's plain form
or text post reaches a route without the browser asking first), its nesting depth (a 2 KB body of 1,000
brackets must reach neither the parser's nor a validator's recursion limit) and its text (a lone
surrogate such as "\\ud800" is not Unicode text: no tokenizer takes it). Those two refusals are a 400
naming the field."""
from __future__ import annotations

import json
import re

from server.errors import APIError, invalid, wrong_type

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")      # the only way a surrogate gets into JSON
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')


def require_json(request) -> None:
    """Request middleware: a POST that brings a body (every POST route takes JSON) must say it is JSON."""
    headers = request.headers
    if request.method != "POST" or (headers.get("content-length", "0").strip() in ("", "0")
                                    and "transfer-encoding" not in headers):
        return
    given = headers.get("content-type", "")
    media = given.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
                            f"{repr(given) if given else 'none'})", code="unsupported_media_type")


def parse_json(raw: bytes, max_depth: int = 64) -> dict:
    """The body as a JSON object, or 400 (malformed, too deep, not text) / 422 (not an object)."""
    try:
        body = json.loads(raw or b"")
    except RecursionError:
        raise _too_deep(_deep_field(raw, max_depth), max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise wrong_type(f"request body must be a JSON object, got {type(body).__name__}")
    if raw.count(b"[") + raw.count(b"{") > max_depth or _SURROGATE_ESCAPE.search(raw):
        _check_values(body, max_depth)
    return body


def _check_values(body: dict, max_depth: int) -> None:
    """Walk the body (iteratively): no container deeper than max_depth, no string or key that holds
    a lone surrogate."""
    stack = []
    for key, value in body.items():
        _check_text(key, _name(key))
        if isinstance(value, (str, list, dict)):
            stack.append((value, _name(key), 2))
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if depth > max_depth:
            raise _too_deep(re.split(r"[.\[]", path, maxsplit=1)[0], max_depth)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            where = f"{path}.{_name(key)}" if isinstance(value, dict) else f"{path}[{key}]"
            if isinstance(key, str):
                _check_text(key, where)
            if isinstance(item, (str, list, dict)):
                stack.append((item, where, depth + 1))


def _check_text(text: str, path: str) -> None:
    m = _SURROGATE.search(text)
    if m:
        raise invalid(f"'{path}' is not valid Unicode text: a lone surrogate (U+{ord(m.group()):04X}) "
                      f"at character {m.start()}", path)


def _name(key: str) -> str:
    """A key as it can appear in an error body (its surrogates escaped)."""
    return key.encode("utf-8", "backslashreplace").decode()


def _too_deep(field: str | None, max_depth: int) -> APIError:
    where = f"'{field}'" if field else "the body"
    return invalid(f"{where} is nested more than {max_depth} levels deep", field)


def _deep_field(raw: bytes, max_depth: int) -> str | None:
    """The top-level key under which the raw body nests past max_depth (for a body too deep for the
    JSON parser itself)."""
    depth, key, expect_key = 0, None, False
    for m in _JSON_TOKEN.finditer(raw):
        token = m.group()
        if token in (b"{", b"["):
            depth += 1
            if depth > max_depth:
                return key
            expect_key = token == b"{" and depth == 1
        elif token in (b"}", b"]"):
            depth -= 1
        elif token in (b",", b":"):
            expect_key = token == b"," and depth == 1
        elif expect_key:
            try:
                key = _name(json.loads(token))
            except ValueError:
                return None
            expect_key = False
    return key
