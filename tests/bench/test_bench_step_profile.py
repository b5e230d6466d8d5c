"""bench/step_profile.py: a rate sweep's trace cut into its phases, and each phase's bare decode step."""
from __future__ import annotations

from bench.step_profile import bare_decode, split_phases


def row(t: float, prefill: int = 0, decode: int = 8, gpu: float | None = 4.0, graphed: bool = True) -> dict:
    return dict(t=t, prefill=prefill, decode=decode, gpu_ms=gpu, graphed=graphed, seqs=decode, planned=True)


def test_a_sweep_trace_is_cut_at_its_longest_idle_gaps():
    first = [row(i * 0.004) for i in range(50)]                         # 16 req/s: steps 4 ms apart
    second = [row(1.0 + i * 0.03, decode=200, gpu=12.0) for i in range(20)]   # 64 req/s, after a 0.8 s gap
    third = [row(3.0 + i * 0.01) for i in range(5)]
    phases = split_phases(first + second + third, 3)
    assert [len(p) for p in phases] == [50, 20, 5]
    assert split_phases(first, 1) == [first]


def test_the_bare_step_is_the_mean_of_the_replayed_decode_steps():
    rows = [row(0, gpu=3.0, decode=10), row(1, gpu=5.0, decode=6), row(2, prefill=1024, decode=10, gpu=18.0),
            row(3, gpu=9.0, graphed=False), row(4, gpu=None)]
    bare = bare_decode(rows)
    assert bare == dict(steps=2, gpu_ms=4.0, median_gpu_ms=5.0, batch=8.0)
    assert bare_decode([row(0, prefill=10)]) is None


def test_the_request_trace_splits_a_ttft_into_its_gaps_and_the_first_tokens_step():
    from bench.request_trace import breakdown, table

    req = dict(id="r", http=10.000, parsed=10.002, scheduled=10.003, first_token=10.020, first_sent=10.021,
               end=10.5)
    steps = [dict(tm=9.990, prefill=0), dict(tm=10.0035, prefill=1024), dict(tm=10.018, prefill=0),
             dict(tm=10.030, prefill=0)]
    gaps = breakdown([req, dict(req, first_token=None, first_sent=None)], steps)
    ms = {k: [round(x, 3) for x in v] for k, v in gaps.items()}
    assert ms["parse"] == [2.0, 2.0] and ms["to scheduled"] == [1.0, 1.0] and ms["to first token"] == [17.0]
    assert ms["to sent"] == [1.0] and ms["ttft (http to sent)"] == [21.0]
    assert ms["wait for its step"] == [1.5] and ms["its step"] == [14.5] and ms["step end to server"] == [2.0]
    assert "| parse | 2 | 2.00 |" in table(gaps)


def test_the_server_writes_a_request_trace(tmp_path):
    """A streamed and a plain completion through the real server (CPU, tiny model): one line each, its
    moments in order."""
    import json
    import urllib.request

    from server.app import create_app
    from server.background import BackgroundServer
    from tests.tiny_engine import tiny_handle

    path = tmp_path / "requests.jsonl"
    handle = tiny_handle()
    try:
        with BackgroundServer(create_app(handle, request_trace=str(path))) as srv:
            for stream in (True, False):
                body = json.dumps({"model": handle.model_name, "prompt": "hello there", "max_tokens": 5,
                                   "stream": stream, "ignore_eos": True}).encode()
                req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as resp:
                    assert resp.status == 200
                    resp.read()
    finally:
        handle.shutdown()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["stream"] for r in rows] == [True, False] and all(r["completion_tokens"] == 5 for r in rows)
    for r in rows:
        assert r["http"] <= r["parsed"] <= r["scheduled"] <= r["first_token"] <= r["end"]
    assert rows[0]["first_sent"] >= rows[0]["first_token"] and rows[1]["first_sent"] is None
