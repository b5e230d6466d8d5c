"""Typed, range-checked access to a JSON object's fields: every refusal is an APIError naming the
field and its allowed range (422 for a wrong JSON type or a missing field, 400 for a value out of range)."""
from __future__ import annotations

import math

import numpy as np

from server.errors import invalid, wrong_type


class Fields:
    """Typed, range-checked access to a JSON object's fields; null means 'use the default'."""

    def __init__(self, body: dict):
        self.body = body

    def raw(self, name: str, default=None):
        value = self.body.get(name)
        return default if value is None else value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise wrong_type(f"'{name}' must be a boolean, got {_type_name(value)}", name)
        return value

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None,
                range_text: str | None = None) -> int | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong_type(f"'{name}' must be an integer, got {_type_name(value)}", name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise invalid(f"'{name}' must be {range_text or _range(lo, hi)}, got {value}", name)
        return value

    def number(self, name: str, default: float) -> float:
        """A finite number; its range is SamplingParams.validate's to check."""
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong_type(f"'{name}' must be a number, got {_type_name(value)}", name)
        value = float(value)
        if not math.isfinite(value):
            raise invalid(f"'{name}' must be a finite number, got {value}", name)
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.raw(name, default)
        if value is not None and not isinstance(value, str):
            raise wrong_type(f"'{name}' must be a string, got {_type_name(value)}", name)
        return value

    def strings(self, name: str) -> list[str]:
        """A string or a list of strings (e.g. `stop`)."""
        value = self.raw(name, [])
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise wrong_type(f"'{name}' must be a string or a list of strings", name)
        if any(s == "" for s in items):
            raise invalid(f"'{name}' must not contain empty strings", name)
        return items

    def token_ids(self, name: str, vocab_size: int | None) -> list[int]:
        return token_id_list(self.raw(name, []), vocab_size, name)


def token_id_list(value, vocab_size: int | None, name: str) -> list[int]:
    """A JSON list of token ids (integers; 1.0 counts as 1, as JSON Schema counts it) as ints, each in the
    vocabulary; 422 / 400 naming the field otherwise."""
    if not isinstance(value, list) or not all_ints(value):
        raise wrong_type(f"'{name}' must be a list of integer token ids", name)
    ids = [int(t) for t in value]
    check_token_ids(ids, vocab_size, name)
    return ids


def check_token_ids(ids: list[int], vocab_size: int | None, name: str) -> None:
    hi = (vocab_size - 1) if vocab_size else None
    if ids and (min(ids) < 0 or (hi is not None and max(ids) > hi)):     # C-speed scans; the loop only to name one
        bad = next(t for t in ids if t < 0 or (hi is not None and t > hi))
        raise invalid(f"'{name}' has token id {bad} outside the vocabulary [0, {hi}]", name)


def all_ints(values: list) -> bool:
    """Every item a JSON integer (not a boolean: its type is bool; a float with no fraction, 1.0, counts, as
    JSON Schema and vLLM's pydantic count it): one C-speed pass over the items' types (a 16k-token prompt:
    ~0.35 ms, half of a Python-level `all`)."""
    types = set(map(type, values))
    if types <= {int}:
        return True
    return types <= {int, float} and all(v.is_integer() and abs(v) < 2 ** 63 for v in values if type(v) is float)


def token_id_array(ids: list, vocab_size: int | None, name: str) -> np.ndarray:
    """A list of JSON integers (all_ints) as int32 token ids, each in the vocabulary, or a 400 naming the first
    that is not. The array travels to the engine as it is (a 16k-token prompt pickles in ~10 µs, a list of
    ints in ~0.3 ms, and the engine checks and hashes it without converting it again)."""
    try:
        a = np.array(ids, dtype=np.int64)
    except OverflowError:                   # beyond 64 bits: no vocabulary has it
        a = None
    if a is None or (a.size and (int(a.min()) < 0 or (vocab_size and int(a.max()) >= vocab_size))):
        check_token_ids(ids, vocab_size, name)
        raise invalid(f"'{name}' has a token id outside the 64-bit range", name)
    return a.astype(np.int32)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"
