"""vLLM's JSON-valued flags (--kv-events-config, --speculative-config): the text parsed into one JSON object."""
from __future__ import annotations

import json


def json_object(text: str) -> dict:
    """The JSON object `text` holds; ValueError saying what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}): {text!r}") from None
    if isinstance(raw, dict):
        return raw
    raise ValueError(f"a JSON object is needed, got {text!r}")
