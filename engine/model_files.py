"""ModelLoadError: a model file that cannot be used, named with what is wrong with it; and the JSON
reading every model file shares (config.json, generation_config.json, the shard index, the tokenizer's)."""
from __future__ import annotations

import json
import os
from typing import Any


class ModelLoadError(ValueError):
    """A model file (or folder) that cannot be loaded; the message starts with its path and says what
    is wrong, so the user can act on it (the CLI prints it without a traceback)."""


def read_json_object(path: str, required: bool = True) -> dict[str, Any]:
    """The JSON object in `path`; {} for a missing file unless `required` (FileNotFoundError then).
    ModelLoadError for a file that is not UTF-8, not JSON, or holds something other than an object."""
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"model file not found: {path}")
        return {}
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                             f"a JSON file is expected") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, not a {type(value).__name__}")
    return value
