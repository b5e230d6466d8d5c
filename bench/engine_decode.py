"""Decode throughput of the whole engine on the GPU: EngineHandle (engine thread, scheduler,
detokenizer with the real Qwen tokenizer, asyncio consumers) over the GPU executor with random
Qwen3 weights, in three host modes: "off" (no CPU/GPU overlap: EngineConfig.overlap_steps off),
"emit" (step N's tokens detokenized and sent while step N+1 runs; schedule_ahead off) and "ahead"
(also step N+1 scheduled and built while step N runs: the default).

    python3 bench/engine_decode.py --model qwen3-4b --batches 32,128 --output-len 128 [--temperature 0.8]

B requests of 128 random prompt tokens each decode output-len tokens greedily (ignore_eos), all
submitted at once, after one unreported warm-up pass per batch size (it captures the decode graphs); reported: output tokens/s over the decode phase (from the first streamed token of
the last request to start until the end) and the median inter-token time per request.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


async def _drive(handle, requests) -> dict:
    from engine.events import Token

    firsts, lasts, gaps = [], [], []

    async def one(r):
        prev, n = None, 0
        async for e in handle.submit(r):
            if isinstance(e, Token):
                now = time.perf_counter()
                if prev is None:
                    firsts.append(now)
                else:
                    gaps.append(now - prev)
                prev, n = now, n + 1
        lasts.append(prev)
        return n

    counts = await asyncio.gather(*(one(r) for r in requests))
    decode_s = max(lasts) - max(firsts)
    tokens_after = sum(counts) - len(counts)
    return dict(tokens_per_s=tokens_after / decode_s, itl_ms=float(np.median(gaps)) * 1e3, tokens=sum(counts))


class _Kept:
    """The executor, shared by several handles: a handle's shutdown must not close it."""

    def __init__(self, ex):
        self._ex = ex

    def __getattr__(self, name):
        return getattr(self._ex, name)

    def close(self) -> None:
        pass


MODES = {"off": dict(overlap_steps=False), "emit": dict(overlap_steps=True, schedule_ahead=False),
         "ahead": dict(overlap_steps=True, schedule_ahead=True)}


def run(model_name: str, batches: list[int], output_len: int, prompt_len: int = 128,
        temperature: float = 0.0, modes: tuple[str, ...] = tuple(MODES)) -> list[dict]:
    from engine.config import EngineConfig
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.handle import EngineHandle
    from engine.loader import load_model
    from engine.request import GenerateRequest, SamplingParams
    from engine.tokenizer import Tokenizer
    from harness.models import write_random_qwen3

    folder = f"/tmp/{model_name}-random"
    write_random_qwen3(os.path.join(ROOT, "bench", "configs", model_name, "config.json"), folder)
    tokenizer = Tokenizer.from_folder(os.environ.get("OPENINFER_TEST_TOKENIZER", "/work/shared/models/qwen-tokenizer"))
    model = load_model(folder)
    max_len = prompt_len + output_len + 16
    ex = GpuExecutor(model, options_of(num_kv_blocks=max(batches) * (-(-max_len // 16)) + 16, max_model_len=max_len,
                                       max_num_batched_tokens=max(2048, max(batches)), max_num_seqs=max(batches),
                                       progress=False))
    rng = np.random.default_rng(0)
    rows = []
    for B in batches:
        for mode in (None,) + modes:                  # None: a warm-up pass (graph capture), not reported
            config = EngineConfig(max_num_seqs=B, max_num_batched_tokens=2048, enable_prefix_caching=False,
                                  **MODES[mode or "ahead"])
            handle = EngineHandle(config, executor=_Kept(ex), tokenizer=tokenizer, model_name=model_name,
                                  max_model_len=max_len)
            params = SamplingParams(temperature=temperature, top_k=50 if temperature else -1, seed=1,
                                    max_tokens=output_len, ignore_eos=True)
            reqs = [GenerateRequest(f"r{i}", rng.integers(1000, 100000, prompt_len).tolist(), params)
                    for i in range(B)]
            try:
                r = asyncio.run(_drive(handle, reqs))
            finally:
                handle.shutdown()
            if mode is None:
                continue
            r.update(model=model_name, batch=B, mode=mode, temperature=temperature)
            print(r, flush=True)
            rows.append(r)
    ex.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--batches", default="32,128")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else with top_k 50")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    a = p.parse_args()
    rows = run(a.model, [int(b) for b in a.batches.split(",")], a.output_len, temperature=a.temperature,
               modes=tuple(a.modes.split(",")))
    print("| model | batch | temperature | host mode | output tokens/s | median ITL ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['temperature']:g} | {r['mode']} | {r['tokens_per_s']:.0f} | "
              f"{r['itl_ms']:.2f} |")


if __name__ == "__main__":
    main()
