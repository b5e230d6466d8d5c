"""Whether a JSON schema's local `$ref`s recurse with no way out: `{"type": "object", "properties": {"a":
{"$ref": "#"}}, "required": ["a"]}` admits no finite JSON value (every instance would contain another),
so no output could ever match it. llguidance finds the other unsatisfiable schemas (a required property
`false`, an empty `anyOf`); this is the recursive case, where its matcher would instead walk on until a
limit or max_tokens.

A reference is satisfiable once one of its instances can be built from satisfiable parts: the least
fixed point over the schema's references, starting from none. Only what certainly rules a value out
counts (a required property, the first minItems items, every allOf part, one anyOf / oneOf part, the
allowed types); anything else (other keywords, remote or anchor references) is taken as satisfiable.
"""
from __future__ import annotations

from urllib.parse import unquote

MAX_REFS = 256                  # distinct references followed; a schema with more is not checked
_ALL_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


def unsatisfiable_ref(schema) -> str | None:
    """The first local `$ref` of `schema` that no finite value satisfies where the schema's root needs
    it, or None (the root is satisfiable, or the schema is not one this checks)."""
    refs = sorted(set(_local_refs(schema)))
    if not refs or len(refs) > MAX_REFS:
        return None
    targets = {ref: _resolve(schema, ref) for ref in refs}
    ok = {ref: target is _MISSING for ref, target in targets.items()}
    grown = True
    while grown:
        grown = False
        for ref in refs:
            if not ok[ref] and _satisfiable(targets[ref], ok):
                ok[ref] = grown = True
    if _satisfiable(schema, ok):
        return None
    return next(ref for ref in refs if not ok[ref])


def _satisfiable(s, ok: dict[str, bool]) -> bool:
    """Whether some finite value satisfies schema `s`, with each local reference as `ok` says."""
    if s is False:
        return False
    if not isinstance(s, dict):
        return True
    ref = s.get("$ref")
    if isinstance(ref, str) and not ok.get(ref, True):
        return False
    parts = s.get("allOf")
    if isinstance(parts, list) and not all(_satisfiable(p, ok) for p in parts):
        return False
    for key in ("anyOf", "oneOf"):
        options = s.get(key)
        if isinstance(options, list) and options and not any(_satisfiable(p, ok) for p in options):
            return False
    types = s.get("type", _ALL_TYPES)
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else _ALL_TYPES
    if any(t not in ("object", "array") for t in types):
        return True
    return ("object" in types and _object_satisfiable(s, ok)) or ("array" in types and _array_satisfiable(s, ok))


def _object_satisfiable(s: dict, ok: dict[str, bool]) -> bool:
    properties = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    required = s.get("required") if isinstance(s.get("required"), list) else []
    for name in required:
        if name in properties:
            value = properties[name]
        elif s.get("patternProperties"):
            continue
        else:
            value = s.get("additionalProperties", True)
        if not _satisfiable(value, ok):
            return False
    return True


def _array_satisfiable(s: dict, ok: dict[str, bool]) -> bool:
    need = s.get("minItems", 0)
    if not isinstance(need, int) or need <= 0:
        return True
    items = s.get("items", True)
    prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
    if isinstance(items, list):                  # draft 4-7 tuples
        prefix, items = items, s.get("additionalItems", True)
    return all(_satisfiable(prefix[i] if i < len(prefix) else items, ok) for i in range(min(need, len(prefix) + 1)))


_MISSING = object()


def _local_refs(node):
    """Every '#...' `$ref` string in `node` (the schema and its definitions)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                yield ref
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _resolve(schema, ref: str):
    """The subschema a '#' / '#/a/b' reference points at (JSON pointer), or _MISSING."""
    node = schema
    for raw in ref[2:].split("/") if ref != "#" else []:
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return _MISSING
    return node
