"""Tables of an engine step trace (`openinfer serve --step-trace FILE`, engine/step_trace.py): where the
time of the steps goes, by kind of step.

    python bench/step_profile.py steps.jsonl [--out table.md]

Kinds: "decode graph" (replayed CUDA graph), "decode eager", "mixed" (prefill and decode tokens),
"prefill". Per kind: steps, mean tokens, mean host phases (ms), mean GPU ms, the host's serial share
(schedule + copy + build + launch + wait beyond the GPU, i.e. what the device waits through) and the
wall share of the run. The serial host time per step is the step's wall time less the GPU time it
overlapped: wall = the time to the next step's start.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

PHASES = ("schedule", "copy", "build", "launch", "emit", "plan", "wait", "process")


def kind(row: dict) -> str:
    if row["prefill"] and row["decode"]:
        return "mixed"
    if row["prefill"]:
        return "prefill"
    return "decode graph" if row["graphed"] else "decode eager"


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per kind: count, mean tokens / phases / gpu_ms / wall_ms, total wall share."""
    for a, b in zip(rows, rows[1:]):
        a["wall"] = (b["t"] - a["t"]) * 1e3
    if rows:
        rows[-1]["wall"] = sum(rows[-1][p] for p in PHASES)
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[kind(r)].append(r)
    total_wall = sum(r["wall"] for r in rows) or 1.0
    out = {}
    for k, rs in sorted(groups.items()):
        n = len(rs)
        mean = {p: sum(r[p] for r in rs) / n for p in PHASES}
        gpu = [r["gpu_ms"] for r in rs if r.get("gpu_ms") is not None]
        wall = sum(r["wall"] for r in rs)
        out[k] = dict(steps=n, prefill=sum(r["prefill"] for r in rs) / n, decode=sum(r["decode"] for r in rs) / n,
                      seqs=sum(r["seqs"] for r in rs) / n, planned=sum(r["planned"] for r in rs) / n,
                      gpu_ms=sum(gpu) / len(gpu) if gpu else None, wall_ms=wall / n, wall_share=wall / total_wall,
                      **mean)
    return out


def table(summary: dict[str, dict]) -> str:
    head = ["kind", "steps", "prefill tok", "decode tok", "planned", *[f"{p} ms" for p in PHASES], "GPU ms",
            "wall ms", "GPU / wall", "wall share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, s in summary.items():
        gpu = s["gpu_ms"]
        cells = [k, str(s["steps"]), f"{s['prefill']:.0f}", f"{s['decode']:.0f}", f"{s['planned']:.2f}",
                 *[f"{s[p]:.3f}" for p in PHASES], "-" if gpu is None else f"{gpu:.2f}", f"{s['wall_ms']:.2f}",
                 "-" if gpu is None else f"{gpu / s['wall_ms']:.2f}", f"{s['wall_share']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_phases(rows: list[dict], phases: int) -> list[list[dict]]:
    """A trace of several benchmark phases run one after another on one server (a rate sweep) cut at its
    phases − 1 longest idle gaps between steps (each phase drains before the next starts)."""
    if phases <= 1 or len(rows) < phases:
        return [rows]
    gaps = sorted(range(1, len(rows)), key=lambda i: rows[i]["t"] - rows[i - 1]["t"], reverse=True)[:phases - 1]
    cuts = [0, *sorted(gaps), len(rows)]
    return [rows[a:b] for a, b in zip(cuts, cuts[1:])]


def bare_decode(rows: list[dict]) -> dict | None:
    """The replayed decode-graph steps of a phase: mean GPU ms (the bare step the serving TPOT is held
    against), its median, and the mean batch; None without GPU timings."""
    gpu = [(r["gpu_ms"], r["decode"]) for r in rows
           if r["graphed"] and not r["prefill"] and r.get("gpu_ms") is not None]
    if not gpu:
        return None
    ms = sorted(g for g, _ in gpu)
    return dict(steps=len(gpu), gpu_ms=sum(ms) / len(ms), median_gpu_ms=ms[len(ms) // 2],
                batch=sum(b for _, b in gpu) / len(gpu))


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    text = table(summarize(load(args.trace)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
