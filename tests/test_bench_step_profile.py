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
