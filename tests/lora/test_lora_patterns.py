"""An adapter's rank_pattern / alpha_pattern keys (regular expressions out of its adapter_config.json) are
matched as PEFT matches them (peft's own get_pattern_key is the oracle), and never run unbounded in the
engine's process: a key that backtracks without bound is refused within the budget, naming it, while the
engine goes on generating."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from peft.utils.other import get_pattern_key

from engine.config import EngineConfig
from engine.events import Token
from engine.handle import EngineHandle
from engine.lora import LoRAError, load_adapter, lora_sites
from engine.lora_patterns import PATTERN_BUDGET_S, first_match, pattern_matches
from engine.request import GenerateRequest, SamplingParams
from harness.lora import adapter_copy, tiny_adapter_path
from harness.models import tiny_model_path

MODEL = "qwen3_tied"
NAMES = [f"model.layers.{i}.{part}" for i in (0, 1, 12)
         for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj", "mlp.up_proj")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOREVER = "(.*.*)*X"                         # backtracks for ever on any of NAMES
SLOW = "(.*)(.*)(.*)(.*)(.*)(.*)(.*)(.*)X"   # seconds per module name (the issue's, one group more)


def adapter_with(tmp_path, **config) -> str:
    return adapter_copy(tiny_adapter_path(MODEL, "attn8"), tmp_path / "adapter", **config)


@pytest.mark.parametrize("keys", [
    ["q_proj", "model.layers.1.mlp.down_proj", "layers.1.self_attn.k_proj"],         # plain names: in process
    [r"layers\.0\.self_attn\.[kv]_proj", "up_proj", r".*\.1\..*", "q_proj"],         # the first match wins
    [r"(?<=attn\.)q_proj", r"(\d)\.mlp\.(down|up)_proj", r"layers\.(1)(2)?\.mlp", "^model.*v_proj", "v_proj|k"],
    ["", ".", "attn.q", r"(\w)\1", "proj", "layers.12"],
])
def test_keys_match_as_peft_matches_them(keys):
    matches = pattern_matches(keys, NAMES)
    pattern = {k: i for i, k in enumerate(keys)}
    for name in NAMES:
        want = get_pattern_key(keys, name)
        assert first_match(pattern, name, matches, None) == pattern.get(want), (name, want)


def test_a_key_that_backtracks_for_ever_is_refused_within_the_budget(tmp_path):
    """Read in a child interpreter, so that the old in-process matching (which holds the interpreter for
    ever) fails the test instead of hanging it."""
    folder = adapter_with(tmp_path, rank_pattern={"q_proj": 4, FOREVER: 4})
    code = ("import time; from engine.lora import LoRAError, load_adapter, lora_sites\n"
            "from engine.loader import load_model; from engine.models.registry import build_model\n"
            f"sites = lora_sites(build_model(load_model({tiny_model_path(MODEL)!r}).config))\n"
            "t = time.monotonic()\n"
            f"try: load_adapter('ad', {folder!r}, sites, 2, 16)\n"
            "except LoRAError as e: print(e.status, round(time.monotonic() - t, 2), e)\n")
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    except subprocess.TimeoutExpired:
        pytest.fail("reading the adapter ran for over 60 s")
    status, seconds, message = run.stdout.strip().split(" ", 2)
    assert status == "400" and f"rank_pattern key {FOREVER!r} is refused" in message, run.stdout + run.stderr
    assert f"took over {PATTERN_BUDGET_S:g} s" in message and float(seconds) < PATTERN_BUDGET_S + 5


@pytest.mark.parametrize("key,words", [
    ("q_proj(", "missing \\), unterminated subpattern"),
    ("a{99999999999}", "the repetition number is too large"),      # OverflowError in re
    ("(" * 3000 + ")" * 3000, "maximum recursion depth"),             # RecursionError in re
])
def test_keys_that_are_no_regular_expression_are_refused_naming_them(tmp_path, sites, key, words):
    folder = adapter_with(tmp_path, alpha_pattern={"q_proj": 2, key: 3})
    with pytest.raises(LoRAError, match=words) as err:
        load_adapter("ad", folder, sites, 2, 16)
    assert err.value.status == 400 and f"alpha_pattern key {key[:40]!r}"[:-1] in str(err.value)


@pytest.fixture(scope="module")
def sites():
    from engine.loader import load_model
    from engine.models.registry import build_model
    return lora_sites(build_model(load_model(tiny_model_path(MODEL)).config))


def test_the_engine_keeps_generating_while_a_backtracking_key_is_matched(tmp_path):
    """A load whose key takes the old in-process matching tens of seconds: tokens keep coming (no gap near
    the budget) and the load is refused within it."""
    folder = adapter_with(tmp_path, rank_pattern={SLOW: 4})
    h = EngineHandle(EngineConfig(model=tiny_model_path(MODEL), device="cpu", num_kv_blocks=64, max_model_len=512,
                                  enable_lora=True, max_loras=1, progress=False))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def main():
        times, refused = [], []

        async def stream():                    # requests one after another until the load has answered
            for i in range(100):
                async for event in h.submit(GenerateRequest(f"g{i}", [5, 6, 7], params)):
                    if isinstance(event, Token):
                        times.append(time.monotonic())
                if refused:
                    return

        async def load():
            await asyncio.sleep(0.2)
            start, err = time.monotonic(), None
            try:
                await h.load_lora_adapter("slow", folder)
            except LoRAError as e:
                err = e
            refused.append((start, time.monotonic(), err))
        await asyncio.gather(stream(), load())
        return times, refused[0]

    try:
        times, (start, end, err) = asyncio.run(main())
    finally:
        h.shutdown()
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = sum(start <= t <= end for t in times)
    print(f"{during} tokens during the {end - start:.2f} s load, largest gap {max(gaps) * 1000:.0f} ms")
    # in process, the match would hold the interpreter for all of it (seconds to forever): a gap under most of the
    # budget means generation went on beside it (the slack is for a loaded 2-core machine's scheduling)
    assert max(gaps) < 0.75 * PATTERN_BUDGET_S and during >= 20, (during, max(gaps))
    assert f"rank_pattern key {SLOW!r} is refused" in str(err) and end - start < PATTERN_BUDGET_S + 3
