"""Benchmark metric definitions, arrival schedules and datasets, checked against their definitions."""
import json
import math
import os

import numpy as np
import pytest

from bench.common import RequestResult
from bench.common_metrics import arrival_offsets, parse_slos, summarize, tpot

QWEN_TOKENIZER = "/work/shared/models/qwen-tokenizer/tokenizer.json"
needs_tokenizer = pytest.mark.skipif(not os.path.exists(QWEN_TOKENIZER), reason="needs the Qwen tokenizer")


def _result(ttft, itl, out, prompt=10, start=0.0, ok=True):
    return RequestResult(success=ok, prompt_len=prompt, output_tokens=out, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), start_time=start)


def test_summarize_matches_definitions():
    rng = np.random.default_rng(1)
    results = []
    for i in range(40):
        itl = rng.uniform(0.01, 0.05, size=int(rng.integers(0, 9))).tolist()
        results.append(_result(rng.uniform(0.05, 0.5), itl, out=len(itl) + 1, start=i * 0.1))
    results.append(_result(1.0, [], 1, ok=False))
    m = summarize(results, duration_s=8.0, percentiles=(50, 99))
    done = results[:-1]
    assert m["completed"] == 40 and m["failed"] == 1
    assert m["total_output_tokens"] == sum(r.output_tokens for r in done)
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / 8.0)
    assert m["request_throughput"] == pytest.approx(5.0)
    ttfts = np.array([r.ttft for r in done]) * 1000
    assert m["mean_ttft_ms"] == pytest.approx(ttfts.mean())
    assert m["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    # TPOT only over requests with > 1 output token: (latency - ttft) / (tokens - 1) = mean ITL here
    tpots = [np.mean(r.itl) * 1000 for r in done if r.output_tokens > 1]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    assert m["mean_itl_ms"] == pytest.approx(np.mean([g for r in done for g in r.itl]) * 1000)
    assert m["p50_e2el_ms"] == pytest.approx(np.median([r.ttft + sum(r.itl) for r in done]) * 1000)
    assert m["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    results = [_result(0.1, [0.02] * 4, 5), _result(0.3, [0.02] * 4, 5),   # TTFT over 200 ms
               _result(0.1, [0.06] * 4, 5), _result(0.15, [], 1)]          # TPOT over 50; 1 token: TPOT 0
    m = summarize(results, 2.0, slo_ms=parse_slos(["ttft:200", "tpot:50"]))
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert tpot(results[3]) == 0.0
    m = summarize(results, 2.0, slo_ms={"e2el": 250})
    assert m["request_goodput"] == pytest.approx(2 / 2.0)  # 180 ms and 150 ms pass; 380, 340 fail
    with pytest.raises(ValueError, match="ttft, tpot or e2el"):
        parse_slos(["latency:5"])


def test_peak_concurrency_and_peak_token_rate():
    # tokens at 0.25 ... 0.75 s and 0.75 ... 1.25 s: 7 fall in second 0; requests overlap in [0.5, 0.75)
    results = [_result(0.25, [0.125] * 4, 5, start=0.0), _result(0.25, [0.125] * 4, 5, start=0.5),
               _result(0.25, [0.125] * 4, 5, start=5.0)]
    m = summarize(results, 6.0)
    assert m["max_concurrent_requests"] == 2
    assert m["max_output_tokens_per_s"] == 7


def test_arrival_offsets():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    np.testing.assert_allclose(arrival_offsets(4, 2.0, math.inf), [0.5, 1.0, 1.5, 2.0])
    for burstiness, cv in [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)]:
        offsets = arrival_offsets(20000, 10.0, burstiness, np.random.default_rng(0))
        assert offsets[-1] == pytest.approx(20000 / 10.0)  # scaled to exactly n / rate
        gaps = np.diff([0.0, *offsets])
        assert gaps.mean() == pytest.approx(0.1, rel=1e-3)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)  # gamma(k): CV = 1/sqrt(k)
    for bad in [(0, 1.0, 1.0), (3, 0.0, 1.0), (3, 1.0, -1.0)]:
        with pytest.raises(ValueError):
            arrival_offsets(*bad)


@needs_tokenizer
def test_random_prompts_have_exact_token_lengths_and_a_shared_prefix():
    from bench.common_data import encode, load_tokenizer, random_requests
    tok = load_tokenizer(QWEN_TOKENIZER)
    for input_len in (1, 5, 100, 1000):
        specs = random_requests(tok, 6, input_len, 3, prefix_len=32, seed=input_len)
        for spec in specs:
            assert spec.prompt_len == input_len + 32 == len(encode(tok, spec.prompt))
            assert spec.output_len == 3
        prefixes = {tuple(encode(tok, s.prompt)[:31]) for s in specs}
        assert len(prefixes) == 1
        assert len({s.prompt for s in specs}) == 6
    again = random_requests(tok, 2, 50, 3, seed=7)
    assert [s.prompt for s in again] == [s.prompt for s in random_requests(tok, 2, 50, 3, seed=7)]


@needs_tokenizer
def test_sharegpt_from_a_local_file(tmp_path):
    from bench.common_data import encode, load_tokenizer, sharegpt_requests
    tok = load_tokenizer(QWEN_TOKENIZER)
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}: " + "tell me more " * (i + 2)},
                               {"from": "gpt", "value": "An answer that is long enough " * (i + 1)}]}
            for i in range(6)]
    rows += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a long reply here"}]},
             {"conversations": [{"from": "human", "value": "one turn only, no reply"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    specs = sharegpt_requests(path, tok, 6, seed=0)
    assert len(specs) == 6 and all(s.prompt.startswith("Question") for s in specs)
    for s in specs:
        assert s.prompt_len == len(encode(tok, s.prompt)) and s.output_len >= 4
    assert {s.output_len for s in sharegpt_requests(path, tok, 3, output_len=9)} == {9}
    with pytest.raises(ValueError, match="only 6 usable"):
        sharegpt_requests(path, tok, 7)
    with pytest.raises(FileNotFoundError, match="ShareGPT file not found"):
        sharegpt_requests(tmp_path / "missing.json", tok, 1)
