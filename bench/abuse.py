"""The abusive inputs of bench/reliability.py and what they do to the streams around them.

`Victims` keep a few streams decoding and time their chunks; an input's stall ratio is the victims'
longest gap between two chunks while the input ran, over their median gap before any input. Each input
is a coroutine returning its outcome: an HTTP status ("400"), "closed" (the server closed the connection
without an answer), "hang" (no answer within its bound) or a transport error's name.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


class Victims:
    """`n` streams decoding (ignore_eos) until stop(); each chunk's arrival time, by stream."""

    def __init__(self, client: httpx.AsyncClient, n: int, headers: dict, max_tokens: int = 4096):
        self.client, self.n, self.headers, self.max_tokens = client, n, headers, max_tokens
        self.runs: list[list[float]] = []          # one list of chunk times per request
        self.current: list[list[float]] = [[] for _ in range(n)]   # each stream's request in progress
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(self.n)]

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, i: int) -> None:
        body = {"prompt": f"Count slowly, stream {i}:", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0.7, "seed": i}
        while not self._stop.is_set():
            times: list[float] = []
            self.runs.append(times)
            self.current[i] = times
            try:
                async with self.client.stream("POST", "/v1/completions", json=body, headers=self.headers,
                                              timeout=600) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"a victim stream was refused: {r.status_code} {await r.aread()!r}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            times.append(time.monotonic())
            except httpx.HTTPError:
                await asyncio.sleep(0.5)

    async def baseline(self, seconds: float, timeout: float = 600.0) -> float:
        """The median gap over `seconds` once every stream has sent chunks (the victims alone)."""
        deadline = time.monotonic() + timeout
        while sum(len(times) >= 5 for times in self.runs) < self.n:
            if time.monotonic() > deadline:
                raise RuntimeError("the victim streams did not start")
            await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        gaps = self.gaps(t0, time.monotonic())
        return statistics.median(gaps) if gaps else 0.0

    def gaps(self, t0: float, t1: float) -> list[float]:
        """Gaps between two chunks of one request that overlap [t0, t1]."""
        return [b - a for times in self.runs for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]

    async def stall_ratio(self, t0: float, t1: float, baseline: float, timeout: float = 600.0) -> float | None:
        """The longest gap overlapping [t0, t1] over `baseline`, once every victim has sent a chunk after t1
        (the gap open when an input ends counts whole)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(not times or times[-1] < t1 for times in self.current):
            await asyncio.sleep(0.05)
        gaps = self.gaps(t0, t1)
        return max(gaps) / baseline if gaps and baseline > 0 else None


async def http_input(client: httpx.AsyncClient, method: str, path: str, content: bytes, headers: dict,
                     bound: float = 120.0) -> str:
    try:
        r = await client.request(method, path, content=content, headers=headers, timeout=bound)
        return str(r.status_code)
    except httpx.TimeoutException:
        return "hang"
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def trickle(host: str, port: int, data: bytes, dribble: bytes, every: float, bound: float) -> str:
    """Send `data`, then `dribble` one byte every `every` s (then 'x's) until the server answers or
    closes; 'hang' after `bound` s."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            try:
                got = await asyncio.wait_for(reader.read(4096), every)
                return got[9:12].decode() if got.startswith(b"HTTP/1.1 ") else "closed"
            except asyncio.TimeoutError:
                writer.write(dribble[:1] or b"x")
                dribble = dribble[1:]
            except ConnectionError:
                return "closed"
        return "hang"
    finally:
        writer.close()


async def trickle_swarm(host: str, port: int, count: int, every: float, hold: float) -> dict:
    """`count` connections trickling their headers one byte every `every` s, for at most `hold` s: how
    many were answered with each status or closed, how many still held at the end, the last cut's time."""
    t0 = time.monotonic()
    cut_at: list[float] = []

    async def one(k: int) -> str:
        await asyncio.sleep(k * 0.005)                     # ramp up: the listener's backlog is finite
        outcome = await trickle(host, port, HEAD, b"X-Slow: " + b"a" * 10_000, every, hold)
        if outcome != "hang":
            cut_at.append(time.monotonic() - t0 - k * 0.005)
        return outcome
    outcomes = await asyncio.gather(*(one(k) for k in range(count)), return_exceptions=True)
    counts: dict[str, int] = {}
    for o in outcomes:
        key = o if isinstance(o, str) else type(o).__name__
        counts[key] = counts.get(key, 0) + 1
    return {"outcomes": counts, "longest_held_s": round(max(cut_at, default=0.0), 1)}


WORDS = "the quick brown fox jumps over a lazy dog while seven quietly hex every box".split()


def long_prompt(tokens: int, seed: int = 0) -> str:
    """A prompt of `tokens` common words (one token each with the demo model's tokenizer), in an order
    that no earlier prompt shares (no prefix cache hit)."""
    import random
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def write_adapter(folder: Path, config: dict, tensors: dict | None = None, raw: bytes | None = None) -> Path:
    """A PEFT folder: adapter_config.json and adapter_model.safetensors (`tensors`, or the bytes `raw`)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    weights = folder / "adapter_model.safetensors"
    if raw is not None:
        weights.write_bytes(raw)
    else:
        save_file(tensors or {}, str(weights))
    return folder


def q_proj_lora(layers: int, hidden: int, rank: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in range(layers):
        base = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        out[f"{base}.lora_A.weight"] = rng.standard_normal((rank, hidden)).astype(np.float32) * 0.01
        out[f"{base}.lora_B.weight"] = rng.standard_normal((hidden, rank)).astype(np.float32) * 0.01
    return out


def lora_inputs(root: Path, layers: int, hidden: int) -> list[tuple[str, str, dict]]:
    """(input, adapter folder name under root, request body) for the adapter inputs: a well-formed adapter,
    catastrophic regular expressions in rank_pattern, malformed safetensors headers."""
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    good = q_proj_lora(layers, hidden)
    write_adapter(root / "good", config, good)
    write_adapter(root / "regex", {**config, "rank_pattern": {"(.*.*)*X": 4}}, good)
    write_adapter(root / "regex7", {**config, "rank_pattern": {"(.*)(.*)(.*)(.*)(.*)(.*)(.*)X": 4}}, good)
    for name, header in (("no-offsets", {"t": {"dtype": "F32", "shape": [1]}}), ("list-header", [1, 2]),
                         ("past-end", {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 30]}}),
                         ("not-object", {"t": 7})):
        text = json.dumps(header).encode()
        write_adapter(root / name, config, raw=len(text).to_bytes(8, "little") + text)
    body = {"prompt": "hi", "max_tokens": 4}
    return ([("LoRA: well-formed adapter (resolver)", "good", body),
             ("LoRA: safetensors header without data_offsets", "no-offsets", body),
             ("LoRA: safetensors header a JSON list", "list-header", body),
             ("LoRA: safetensors offsets past the file's end", "past-end", body),
             ("LoRA: safetensors tensor entry not an object", "not-object", body),
             ("LoRA: rank_pattern (.*)(.*)(.*)(.*)(.*)(.*)(.*)X", "regex7", body),
             ("LoRA: rank_pattern (.*.*)*X", "regex", body)])


def lora_path_inputs(root: Path) -> list[tuple[str, dict]]:
    """/v1/load_lora_adapter bodies naming paths outside any adapter folder."""
    return [("LoRA load: absolute path /etc", {"lora_name": "x1", "lora_path": "/etc"}),
            ("LoRA load: relative path ../..", {"lora_name": "x2", "lora_path": "../.."}),
            ("LoRA load: ~ path", {"lora_name": "x3", "lora_path": "~"}),
            ("LoRA load: a path that does not exist", {"lora_name": "x4", "lora_path": "/no/such/dir"}),
            ("LoRA load: symlink out of the adapter folder", {"lora_name": "x5", "lora_path": str(_symlink_out(root))})]


def _symlink_out(root: Path) -> Path:
    link = root / "escape"
    if not link.exists():
        os.symlink("/etc", link)
    return link
