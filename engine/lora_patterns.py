"""PEFT's per-module ranks and alphas (`rank_pattern` / `alpha_pattern` keys) matched as PEFT matches them,
without running an adapter's regular expressions unbounded in the engine's process.

PEFT (`peft.utils.other.get_pattern_key`) gives a module the value of the first key K, in the file's order,
for which `re.match(rf"(.*\\.)?({K})$", module_name)` matches. A key is a string out of adapter_config.json:
one such as `(.*.*)*X` backtracks for minutes to forever, holding the interpreter (and so every thread of
the engine) meanwhile. So a key of plain name characters (letters, digits, `_`, `-`, `.`: no quantifier,
group, class or escape, whose match is linear work) is matched here, and every other key is compiled and
matched against the adapter's module names by Python's own `re` in a separate interpreter with a time
budget: one that runs out is killed, and the key is refused. Both use Python's `re`, so the semantics are
PEFT's exactly (a linear-time engine such as RE2 lacks some of its syntax: backreferences, lookarounds).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Iterable

PATTERN_BUDGET_S = 2.0          # wall time for matching an adapter's non-plain keys, interpreter start included
_PLAIN = re.compile(r"[\w.-]*")

# stdin: {"keys": [...], "names": [...]}; stdout: one JSON line per key, in order: the indices of the names
# it matches, or {"error": why} for a key that is not a valid regular expression
_WORKER = r"""
import json, re, sys
job = json.loads(sys.stdin.read())
for key in job["keys"]:
    try:
        re.compile(key)
        rx = re.compile(rf"(.*\.)?({key})$")
    except Exception as e:
        print(json.dumps({"error": str(e) or type(e).__name__}), flush=True)
        continue
    print(json.dumps([i for i, name in enumerate(job["names"]) if rx.match(name)]), flush=True)
"""


class PatternError(ValueError):
    """A key refused: `key`, and why ("is not a valid regular expression: ...", "is refused: ...")."""

    def __init__(self, key: str, reason: str):
        super().__init__(reason)
        self.key = key


def pattern_matches(keys: Iterable[str], names: list[str], budget_s: float = PATTERN_BUDGET_S) -> dict[str, set[str]]:
    """key -> the names among `names` it matches under PEFT's rule; PatternError for a bad or too slow key."""
    keys = list(dict.fromkeys(keys))
    out = {k: {n for n in names if _peft_match(k, n)} for k in keys if _PLAIN.fullmatch(k)}
    hard = [k for k in keys if k not in out]
    if hard:
        for key, found in zip(hard, _match_in_worker(hard, names, budget_s)):
            out[key] = {names[i] for i in found}
    return out


def first_match(pattern: dict, name: str, matches: dict[str, set[str]], default):
    """PEFT's lookup: the value of the first key of `pattern` (in its order) matching `name`, else default."""
    return next((value for key, value in pattern.items() if name in matches[key]), default)


def _peft_match(key: str, name: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", name) is not None


def _match_in_worker(keys: list[str], names: list[str], budget_s: float) -> list[list[int]]:
    job = json.dumps({"keys": keys, "names": names}).encode()
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WORKER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(job, timeout=budget_s)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.communicate()
        running = keys[(e.output or b"").count(b"\n")]
        raise PatternError(running, f"is refused: matching it against the adapter's {len(names)} module names "
                                    f"took over {budget_s:g} s (a pattern that backtracks without bound?)") from None
    lines = out.decode().splitlines()
    if proc.returncode != 0 or len(lines) != len(keys):
        failed = keys[min(len(lines), len(keys) - 1)]
        raise PatternError(failed, f"is refused: matching it failed (exit status {proc.returncode}: "
                                   f"{err.decode(errors='replace')[-300:].strip()})")
    results = [json.loads(line) for line in lines]
    for key, result in zip(keys, results):
        if isinstance(result, dict):
            raise PatternError(key, f"is not a valid regular expression: {result['error']}")
    return results
