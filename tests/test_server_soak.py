"""The reliability soak at CI size (bench/soak.py): 300 mixed requests, 64 at a time, every tenth client
leaving mid-request, against the real engine (CPU, tiny model) — no error, and once idle no request
and no KV block left in the engine. bench/results/reliability.md records a larger run."""
from __future__ import annotations

import asyncio

from bench.soak import run_soak
from server.app import create_app
from server.background import BackgroundServer
from tests.tiny_engine import tiny_handle


def test_soak_300_requests_64_concurrent_10_percent_disconnects_leaks_nothing():
    handle = tiny_handle(num_kv_blocks=256, max_num_seqs=64)
    try:
        with BackgroundServer(create_app(handle)) as srv:
            result = asyncio.run(run_soak(srv.url, requests=300, concurrency=64, disconnect_rate=0.1,
                                          max_tokens=12, seed=0))
        stats = handle.stats()
    finally:
        handle.shutdown()
    assert result.errors == 0, result.error_samples
    assert result.disconnected >= 25 and result.completed + result.disconnected == 300
    assert result.requests_left == 0 and result.leaked_kv_blocks == 0
    assert stats.num_requests == 0 and stats.num_running == 0 and stats.kv_blocks_used == 0
    assert stats.generation_tokens_total > result.completed       # the engine did the work
