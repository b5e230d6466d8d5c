"""Where the host's time goes while it launches an eager (prefill / mixed) step: cProfile around
GpuExecutor.submit (upload, planning, every kernel launch, up to the step's return; the GPU runs on),
Qwen3-4B real shapes with random bf16 weights, the steps of bench/mixed_step.py.

    python3 bench/launch_profile.py --out DIR [--scenarios 1x1024,8x1024] [--top 35]
Writes DIR/launch_profile.md: per scenario the submit time and the top functions by own time and by
cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def profile_submit(ex, batch, top: int, reps: int = 3) -> tuple[float, str, str]:
    """Median submit ms (synchronized between reps) and the profile's two tables of the last rep."""
    times, prof = [], None
    for _ in range(reps):
        ex.stream.synchronize()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        pending = ex.submit(batch)
        prof.disable()
        times.append((time.perf_counter() - t) * 1e3)
        pending.result()
    tables = []
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        tables.append(s.getvalue())
    return sorted(times)[len(times) // 2], tables[0], tables[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--scenarios", default="1x1024,8x1024")
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from bench.mixed_step import build_step, parse_scenario, random_executor

    scenarios = [parse_scenario(s) for s in a.scenarios.split(",")]
    model, ex = random_executor(a.model, scenarios, 1100)
    lines = []
    for (n_prompts, length, decodes, prefix), name in zip(scenarios, a.scenarios.split(",")):
        batch = build_step(n_prompts, length, decodes, 1100, model.config.vocab_size - 1000, prefix=prefix)
        ex.execute(batch)                                   # warm-up
        ms, own, cum = profile_submit(ex, batch, a.top)
        print(f"{name}: submit {ms:.2f} ms", flush=True)
        lines += [f"## {name}: submit {ms:.2f} ms (median of 3, under cProfile)", "", "```", own, "```", "", "```", cum, "```", ""]
    ex.close()
    text = "\n".join(lines)
    with open(os.path.join(a.out, "launch_profile.md"), "w") as f:
        f.write(text)
    print(text[:20000])


if __name__ == "__main__":
    main()
