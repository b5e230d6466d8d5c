"""bench/host_tier_load.py's split of the streams' inter-token gaps: a gap counts as during a hit when its
interval overlaps the hit's wait (send to first token), otherwise as without hits."""
from __future__ import annotations

import pytest

from bench.common import RequestResult
from bench.host_tier_load import gap_summary


def test_gaps_overlapping_a_hit_wait_are_split_from_the_others():
    # a stream whose first token is at 1.0 s, then gaps of 0.1, 0.5, 0.1, 0.1 s: tokens at 1.1, 1.6, 1.7, 1.8
    stream = RequestResult(success=True, start_time=0.0, ttft=1.0, itl=[0.1, 0.5, 0.1, 0.1], output_tokens=5)
    hit = RequestResult(success=True, start_time=1.2, ttft=0.3, cached_tokens=240)   # waits 1.2 .. 1.5 s
    out = gap_summary([stream], [hit], duration=2.0)
    assert out["gaps_during_hits_ms"]["n"] == 1 and out["gaps_during_hits_ms"]["max"] == pytest.approx(500)
    assert out["gaps_without_hits_ms"]["n"] == 3 and out["gaps_without_hits_ms"]["max"] == pytest.approx(100)
    assert out["hit_ttft_ms"] == [pytest.approx(300)] and out["hit_cached_tokens"] == [240]
    assert out["output_tok_s"] == pytest.approx(2.5)


def test_no_hits_leaves_every_gap_outside():
    stream = RequestResult(success=True, start_time=0.0, ttft=0.5, itl=[0.1, 0.1], output_tokens=3)
    out = gap_summary([stream], [], duration=1.0)
    assert out["gaps_during_hits_ms"] == {"n": 0, "p50": None, "p99": None, "max": None}
    assert out["gaps_without_hits_ms"]["n"] == 2
