"""Host cost of structured output per decode step at batch 32 with 0 / 8 / 32 constrained rows.

(a) the mask alone, with the real Qwen tokenizer (152K vocab): llguidance filling the step's bitmask
rows (engine/grammar.py step_bitmask), the CPU sampler's application of them, and the matchers taking
the sampled tokens, over whole generations of a JSON schema (tokens drawn from each mask at random);
(b) the CPU engine's decode step on the tiny Qwen3 (same tokenizer), 32 requests, k of them constrained.

    python bench/structured_mask.py [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.grammar import GrammarCache, allowed_tokens, step_bitmask  # noqa: E402
from server.structured import json_grammar  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "email": {"type": "string", "format": "email"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
          "required": ["name", "age", "email", "tags"], "additionalProperties": False}
BATCH = 32


def mask_costs(tokenizer, constrained: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Median ms per step of: fill (llguidance), apply (the CPU sampler's masking), accept."""
    cache = GrammarCache(tokenizer, None, tokenizer.eos_token_ids)
    grammar = json_grammar(SCHEMA, "schema")
    cache.compile(grammar)
    rng = np.random.default_rng(seed)
    vocab = cache.llt().vocab_size
    fresh = lambda: cache.matcher(grammar)  # noqa: E731
    grammars = [fresh() if i < constrained else None for i in range(BATCH)]
    logits = np.zeros((BATCH, vocab), np.float32)
    fill, apply, accept = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        rows, masks = step_bitmask(grammars)
        t1 = time.perf_counter()
        picks = []
        for i, m in zip(rows, masks if masks is not None else []):
            allowed = allowed_tokens(m, vocab)
            logits[i][~allowed] = -np.inf
            picks.append((i, allowed))
        t2 = time.perf_counter()
        for i, allowed in picks:
            if grammars[i].done:
                grammars[i] = fresh()         # a finished row starts a new request
                continue
            grammars[i].accept(int(rng.choice(np.flatnonzero(allowed))))
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        accept.append(t3 - t2)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"fill": ms(fill), "fill_mean": 1e3 * statistics.fmean(fill), "fill_max": 1e3 * max(fill),
            "apply": ms(apply), "accept": ms(accept)}


def engine_step_ms(constrained: int, steps: int) -> float:
    """Median wall time of a CPU engine decode step, 32 requests, `constrained` of them under SCHEMA."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from fake_executor import make_engine, submit
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from engine.request import GenerateRequest, SamplingParams
    from harness.models import tiny_model_path

    model = load_model(tiny_model_path("qwen3_tied"))
    ex = CpuExecutor(model, options_of(num_kv_blocks=512, max_model_len=512))
    engine = make_engine(ex, model.tokenizer, max_model_len=512, max_num_seqs=64)
    grammar = json_grammar(SCHEMA, "schema")
    for i in range(BATCH):
        submit(engine, GenerateRequest(f"r{i}", [11, 12, 13 + i], SamplingParams(
            temperature=1.0, seed=i, max_tokens=steps + 8, ignore_eos=True,
            grammar=grammar if i < constrained else None)))
    engine.step()                           # prefill
    times = []
    for _ in range(steps):
        if len(engine.scheduler.running) < BATCH:
            break                           # a constrained request finished: the batch is no longer 32
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    from engine.tokenizer import Tokenizer
    from harness.models import qwen_tokenizer_dir
    tokenizer = Tokenizer.from_folder(qwen_tokenizer_dir())
    print("| constrained rows of 32 | mask fill (median / mean / max ms) | CPU masking (ms) | accept + the bench's random pick (ms) |")
    print("| --- | --- | --- | --- |")
    for k in (0, 8, 32):
        c = mask_costs(tokenizer, k, args.steps * 4)
        print(f"| {k} | {c['fill']:.2f} / {c['fill_mean']:.2f} / {c['fill_max']:.1f} | {c['apply']:.2f} | {c['accept']:.2f} |")
    print()
    print("| constrained rows of 32 | CPU engine decode step, tiny Qwen3 (median ms) |")
    print("| --- | --- |")
    for k in (0, 8, 32):
        print(f"| {k} | {engine_step_ms(k, args.steps):.1f} |")


if __name__ == "__main__":
    main()
