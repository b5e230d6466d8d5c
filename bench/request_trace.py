"""Where a request's time to first token goes: the server's request trace (`openinfer serve --request-trace
FILE`, server/request_trace.py), optionally with the engine's step trace (`--step-trace`) on the same clock.

    python bench/request_trace.py requests.jsonl [--steps steps.jsonl]

Per request, the gaps between its moments (ms): parse (body to tokenized prompt), to scheduled (to the
engine and back with its Scheduled event; the engine process sends a step's events together once its tokens
are known, so for a prompt prefilled in one step this holds the step too), to first token,
to sent (the first chunk written); with the step trace, the step that computed the first token (the last
step with prompt tokens that began before the token arrived) splits "to first token" into the wait for
that step, its wall time, and the token's way from its end to the server. Prints the medians (and p90) as
a table; the requests whose TTFT the target counts are those with a first token.
"""
from __future__ import annotations

import argparse
import json
import sys

GAPS = (("parse", "http", "parsed"), ("to scheduled", "parsed", "scheduled"),
        ("to first token", "scheduled", "first_token"), ("to sent", "first_token", "first_sent"))


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def first_token_step(req: dict, steps: list[dict]) -> tuple[float, float] | None:
    """(start, end) on the monotonic clock of the last step with prompt tokens that began after the request
    was parsed and before its first token reached the server; None if there is none."""
    found = None
    for a, b in zip(steps, steps[1:]):
        if a["prefill"] and req["parsed"] <= a["tm"] <= req["first_token"]:
            found = (a["tm"], b["tm"])
    return found


def breakdown(requests: list[dict], steps: list[dict] | None = None) -> dict[str, list[float]]:
    """Each gap's values in ms over the requests that have both of its moments."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in GAPS}
    out["ttft (http to sent)"] = []
    if steps:
        out.update({"wait for its step": [], "its step": [], "step end to server": []})
    for r in requests:
        for name, a, b in GAPS:
            if r.get(a) is not None and r.get(b) is not None:
                out[name].append((r[b] - r[a]) * 1e3)
        end = r.get("first_sent") or r.get("first_token")
        if end is not None:
            out["ttft (http to sent)"].append((end - r["http"]) * 1e3)
        if steps and r.get("first_token") is not None:
            step = first_token_step(r, steps)
            if step is not None:
                out["wait for its step"].append((step[0] - r["parsed"]) * 1e3)
                out["its step"].append((step[1] - step[0]) * 1e3)
                out["step end to server"].append((r["first_token"] - step[1]) * 1e3)
    return out


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def table(gaps: dict[str, list[float]]) -> str:
    lines = ["| gap | requests | median ms | p90 ms |", "|---|---|---|---|"]
    for name, values in gaps.items():
        if values:
            lines.append(f"| {name} | {len(values)} | {percentile(values, 0.5):.2f} | {percentile(values, 0.9):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("requests")
    p.add_argument("--steps", default=None, help="the engine's step trace of the same run (rows with `tm`)")
    a = p.parse_args(argv)
    steps = [s for s in load(a.steps) if "tm" in s] if a.steps else None
    text = table(breakdown(load(a.requests), steps))
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
