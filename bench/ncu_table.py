"""Per-kernel GPU time of one profiled decode graph from Nsight Compute's CSV (bench/decode.py
--profile-graph B under `ncu --profile-from-start off --graph-profiling node --print-units base --csv
--metrics gpu__time_duration.sum`): one row per kernel name, in graph order, with its launches, total
and mean µs, and the sum against the graph's replay time.

    python3 bench/ncu_table.py ncu.csv [--graph-ms 1.045]
"""
from __future__ import annotations

import argparse
import csv
import io

UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def kernel_times(text: str) -> list[tuple[str, float]]:
    """(kernel name, µs) per profiled kernel, in launch order."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    out = []
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        name = row["Kernel Name"].split("(")[0].split("<")[0].strip()
        out.append((name, value * UNIT_US.get(row.get("Metric Unit", "nsecond"), 1e-3)))
    return out


def table(times: list[tuple[str, float]], graph_ms: float | None = None) -> str:
    order: dict[str, list[float]] = {}
    for name, us in times:
        order.setdefault(name, []).append(us)
    total = sum(us for _, us in times)
    rows = ["| kernel | launches | total µs | mean µs | share |", "|---|---|---|---|---|"]
    for name, v in sorted(order.items(), key=lambda kv: -sum(kv[1])):
        rows.append(f"| {name} | {len(v)} | {sum(v):.1f} | {sum(v) / len(v):.2f} | {sum(v) / total:.2f} |")
    rows.append(f"| all kernels, each timed alone | {len(times)} | {total:.1f} | | |")
    if graph_ms:
        rows.append(f"\nGraph replay {graph_ms * 1e3:.1f} µs: kernels alone {total:.1f} µs, the rest "
                    f"({graph_ms * 1e3 - total:.1f} µs, {len(times)} nodes) is launch gaps and tails.")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--graph-ms", type=float, default=None)
    a = p.parse_args()
    with open(a.csv, encoding="utf-8", errors="replace") as f:
        print(table(kernel_times(f.read()), a.graph_ms))


if __name__ == "__main__":
    main()
