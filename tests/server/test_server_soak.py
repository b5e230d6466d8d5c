"""The reliability soak at CI size (bench/soak.py): 500 mixed requests, 64 at a time, every tenth client
leaving mid-request, against the real engine in its own process (CPU, tiny model) as `openinfer serve`
runs it — no error, and once idle no request, no running or waiting sequence and no KV block left in the
engine. bench/results/reliability.md records a run on the demo model."""
from __future__ import annotations

import asyncio

import pytest

from bench.soak import run_soak
from engine.config import EngineConfig
from engine.process import EngineClient
from harness.models import tiny_model_path
from server.app import create_app
from server.background import BackgroundServer


@pytest.mark.slow                  # 20-60 s on 2 cores
def test_soak_500_requests_64_concurrent_10_percent_disconnects_leaks_nothing():
    config = EngineConfig(model=tiny_model_path("qwen3_tied"), device="cpu", max_model_len=256, num_kv_blocks=256,
                          max_num_seqs=64, progress=False)
    with EngineClient(config) as handle:
        with BackgroundServer(create_app(handle)) as srv:
            result = asyncio.run(run_soak(srv.url, requests=500, concurrency=64, disconnect_rate=0.1,
                                          max_tokens=12, seed=0))
        stats = handle.stats()
    assert result.errors == 0, result.error_samples
    assert result.disconnected >= 45 and result.completed + result.disconnected == 500
    assert result.requests_left == 0 and result.leaked_kv_blocks == 0
    assert stats.num_requests == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_used == 0
    assert stats.generation_tokens_total > result.completed       # the engine did the work
