"""Prefix-cache TTFT sweep: cold TTFT vs warm (prefix-hit) TTFT against prompt length.

For each length L a fresh random prompt of exactly L tokens is sent once (cold: nothing of it can be
cached), then again with its last token replaced (warm: everything before the last token can come
from the prefix cache). With --host-tier, the server's device prefix cache is then reset
(POST /reset_prefix_cache: a server started with a host KV tier offloads it there) and the warm prompt
is sent a third time: its prefix comes back from the host tier (host). Requests go one at a time; the
table reports the TTFTs and the `cached_tokens` each response's usage reports. --token-ids sends the
prompts as token-id lists (what the server then skips: tokenizing the text, ~40 ms for 16k tokens).

    python -m bench.prefix_ttft --base-url http://127.0.0.1:8000 --lengths 256,1024,4096,16384 [--host-tier]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bench.common import (RequestSpec, auth_headers, build_payload, endpoint_path,  # noqa: E402
                          make_client, send_request)
from bench.common_data import allowed_token_ids, encode, exact_length_prompt, load_tokenizer  # noqa: E402
from bench.common_report import pyplot  # noqa: E402
from bench.serve import probe  # noqa: E402


def prompt_pair(tokenizer: Tokenizer, length: int, rng: np.random.Generator,
                allowed: np.ndarray) -> tuple[str, str]:
    """(cold, warm) prompt texts of exactly `length` tokens whose token ids differ only in the last."""
    cold_text, cold_ids = exact_length_prompt(tokenizer, rng.choice(allowed, length).tolist(), allowed, rng)
    for candidate in rng.choice(allowed, 200):
        warm_ids = cold_ids[:-1] + [int(candidate)]
        if warm_ids == cold_ids:
            continue
        warm_text = tokenizer.decode(warm_ids, skip_special_tokens=False)
        if encode(tokenizer, warm_text) == warm_ids:  # survives the round trip: shares length-1 tokens
            return cold_text, warm_text
    raise RuntimeError(f"found no one-token variant of a {length}-token prompt that round-trips")


async def measure(base_url: str, model: str, prompts: list[tuple[int, str, str]], output_len: int,
                  api_key: str | None, host_tier: bool = False) -> list[dict]:
    """Send each pair cold then warm (then, with host_tier, warm again after a prefix-cache reset), one
    request at a time."""
    path, headers, rows = endpoint_path("completions"), auth_headers(api_key), []
    async with make_client(base_url) as client:
        for length, cold, warm in prompts:
            row = {"length": length}
            sends = [("cold", cold), ("warm", warm)] + ([("host", warm)] if host_tier else [])
            for name, text in sends:
                if name == "host":              # the device copy goes (to the host tier, where there is one)
                    async with client.request("POST", "/reset_prefix_cache", headers=headers) as reset:
                        body = await reset.read()
                    if reset.status != 200:
                        raise RuntimeError(f"POST /reset_prefix_cache answered {reset.status}: {body[:300]!r}")
                payload = build_payload(RequestSpec(text, length, output_len), model, "completions", True)
                r = await send_request(client, path, payload, length, headers)
                if not r.success:
                    raise RuntimeError(f"{name} request of {length} tokens failed: {r.error}")
                if name == "cold" and r.cached_tokens:
                    print(f"  warning: the cold {length}-token prompt hit {r.cached_tokens} cached tokens",
                          flush=True)
                row.update({f"{name}_ttft_ms": r.ttft * 1000, f"{name}_cached_tokens": r.cached_tokens,
                            f"{name}_prompt_tokens": r.prompt_len})
            host = f", host {row['host_ttft_ms']:9.1f} ms (cached {row['host_cached_tokens']})" if host_tier else ""
            print(f"  {length:>6} tokens: cold {row['cold_ttft_ms']:9.1f} ms, warm {row['warm_ttft_ms']:9.1f} ms, "
                  f"cached {row['warm_cached_tokens']}{host}", flush=True)
            rows.append(row)
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """Median over the repeats of each length."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        group = [r for r in rows if r["length"] == length]
        row = {"length": length, "repeats": len(group)}
        for key in group[0]:
            if key != "length":
                values = [r[key] for r in group if r[key] is not None]
                row[key] = float(np.median(values)) if values else None
        row["speedup"] = row["cold_ttft_ms"] / row["warm_ttft_ms"]
        if "host_ttft_ms" in row:
            row["host_speedup"] = row["cold_ttft_ms"] / row["host_ttft_ms"]
        out.append(row)
    return out


def markdown(summary: list[dict]) -> str:
    def cell(value):
        return "n/a" if value is None else f"{value:g}"
    host = bool(summary) and "host_ttft_ms" in summary[0]
    lines = ["| prompt tokens | cold TTFT (ms) | warm TTFT (ms) | cold / warm | cached tokens cold / warm "
             + ("| host-tier TTFT (ms) | cold / host | cached tokens host " if host else "") + "| repeats |",
             "| --- " * (9 if host else 6) + "|"]
    for r in summary:
        extra = (f"| {r['host_ttft_ms']:.1f} | {r['host_speedup']:.1f}x | {cell(r['host_cached_tokens'])} "
                 if host else "")
        lines.append(f"| {r['length']} | {r['cold_ttft_ms']:.1f} | {r['warm_ttft_ms']:.1f} | {r['speedup']:.1f}x "
                     f"| {cell(r['cold_cached_tokens'])} / {cell(r['warm_cached_tokens'])} {extra}| {r['repeats']} |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path, title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = [r["length"] for r in summary]
    for key in ("cold", "warm", "host"):
        if f"{key}_ttft_ms" not in summary[0]:
            continue
        ax.plot(lengths, [r[f"{key}_ttft_ms"] for r in summary], marker="o", label=f"{key} TTFT")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder) of the served model")
    p.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384")
    p.add_argument("--repeats", type=int, default=1, help="fresh prompt pairs per length (median reported)")
    p.add_argument("--output-len", type=int, default=1)
    p.add_argument("--seed", type=int, default=None,
                   help="prompt seed (default: a fresh one per run, so cold prompts are never cached)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out-dir", default="bench/out/prefix_ttft")
    p.add_argument("--label", default="prefix_ttft")
    p.add_argument("--token-ids", action="store_true",
                   help="send the prompts as token-id lists (no tokenization on the server) instead of text")
    p.add_argument("--host-tier", action="store_true",
                   help="also time a host-tier hit: reset the device prefix cache, then send the warm prompt again")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n < 2 for n in lengths) or args.repeats < 1:
        raise ValueError("--lengths must all be >= 2 tokens and --repeats >= 1")
    if args.seed is None:
        args.seed = int(time.time_ns() % 2**32)
    tokenizer = load_tokenizer(args.tokenizer)
    rng, allowed = np.random.default_rng(args.seed), allowed_token_ids(tokenizer)
    prompts = [(n, *prompt_pair(tokenizer, n, rng, allowed)) for _ in range(args.repeats) for n in lengths]
    if args.token_ids:          # the pairs round-trip: their ids are exactly the texts' tokens
        prompts = [(n, encode(tokenizer, cold), encode(tokenizer, warm)) for n, cold, warm in prompts]
    warmup = RequestSpec(prompt_pair(tokenizer, 32, rng, allowed)[0], 32, args.output_len)
    model = asyncio.run(probe(args.base_url, args.model, warmup, "completions", True, args.api_key))
    print(f"{model}: cold vs warm TTFT over {len(prompts)} prompt pairs", flush=True)
    rows = asyncio.run(measure(args.base_url, model, prompts, args.output_len, args.api_key, args.host_tier))
    summary = aggregate(rows)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m bench.prefix_ttft " + shlex.join(sys.argv[1:] if argv is None else argv),
              "base_url": args.base_url, "model": model, "seed": args.seed, "summary": summary, "rows": rows}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.label}.json").write_text(json.dumps(report, indent=2))
    table = markdown(summary)
    (out_dir / f"{args.label}.md").write_text(f"# Prefix-cache TTFT: {model}\n\n- date: {report['date']}\n"
                                               f"- command: `{report['command']}`\n\n{table}\n")
    plot(summary, out_dir / f"{args.label}.png", f"{model}: prefix-hit TTFT")
    print(table, flush=True)
    return report


if __name__ == "__main__":
    try:
        main()
    except (ValueError, RuntimeError, OSError) as exc:  # bad arguments, data or server: say which
        sys.exit(f"error: {exc}")
