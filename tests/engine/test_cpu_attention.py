"""NumpyOps' paged attention (engine/executor/cpu_attention.py) against the definition, written plainly in
float64: per query head, softmax(q·k^T·scale) over the keys up to the query's position, times V, with
query head h reading kv head h // G (GQA), the context gathered from scattered pool blocks."""
import time

import ml_dtypes
import numpy as np
import pytest

from engine.executor import cpu_attention
from engine.executor.cpu_attention import PagedAttention
from engine.executor.cpu_workers import Workers
from memory.kv_pool import BLOCK_SIZE


def oracle(q, k_plane, v_plane, blocks, L, positions, scale):
    n, Hq, D = q.shape
    G = Hq // k_plane.shape[2]
    k = k_plane[blocks].reshape(-1, *k_plane.shape[2:])[:L].astype(np.float64)
    v = v_plane[blocks].reshape(-1, *v_plane.shape[2:])[:L].astype(np.float64)
    out = np.empty((n, Hq, D))
    for t in range(n):
        for h in range(Hq):
            s = k[:positions[t] + 1, h // G] @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ v[:positions[t] + 1, h // G] / p.sum()
    return out


def case(Hq: int, Hkv: int, D: int, L: int, n: int, seed: int, spare: int):
    """(q, k_plane, v_plane, blocks, L, positions): n queries ending a context of L keys in scattered blocks
    of a pool with `spare` more blocks than the context needs."""
    rng = np.random.default_rng(seed)
    nb = -(-L // BLOCK_SIZE)
    k_plane, v_plane = (rng.standard_normal((nb + spare, BLOCK_SIZE, Hkv, D), dtype=np.float32) for _ in range(2))
    blocks = rng.permutation(nb + spare)[:nb]
    q = rng.standard_normal((n, Hq, D), dtype=np.float32) * 2
    return q, k_plane, v_plane, blocks, L, np.arange(L - n, L)


@pytest.mark.parametrize("Hq,Hkv,D,L,n", [(9, 3, 64, 1500, 4), (8, 2, 32, 37, 37), (4, 4, 16, 100, 1),
                                          (6, 1, 128, 700, 20), (2, 1, 8, 16, 3), (4, 2, 16, 17, 1)])
def test_attention_matches_definition(Hq, Hkv, D, L, n, monkeypatch):
    monkeypatch.setattr(cpu_attention, "STAGE_BYTES", 3 * BLOCK_SIZE * Hkv * D * 4)   # several groups
    q, k_plane, v_plane, blocks, L, positions = case(Hq, Hkv, D, L, n, L + n, 9)
    got = PagedAttention().attend(q, k_plane, v_plane, blocks, L, positions, D ** -0.5)
    assert got.dtype == np.float32 and got.shape == (n, Hq, D)
    np.testing.assert_allclose(got, oracle(q, k_plane, v_plane, blocks, L, positions, D ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("Hq,Hkv,D,L,n", [(9, 3, 64, 1500, 4), (6, 1, 128, 700, 20), (4, 2, 16, 17, 1),
                                          (8, 2, 32, 200, 200)])
def test_workers_give_one_workers_numbers(Hq, Hkv, D, L, n, workers, monkeypatch):
    """A long context split over threads (its key groups, then its value groups) computes every number as one
    thread does: equal bit for bit, and the definition's."""
    monkeypatch.setattr(cpu_attention, "STAGE_BYTES", 3 * BLOCK_SIZE * Hkv * D * 4)
    monkeypatch.setattr(cpu_attention, "PARALLEL_KEYS", 16)
    q, k_plane, v_plane, blocks, L, positions = case(Hq, Hkv, D, L, n, L * n, 5)
    one = PagedAttention().attend(q, k_plane, v_plane, blocks, L, positions, D ** -0.5)
    split = PagedAttention(Workers(workers))
    for _ in range(2):      # the staging buffers reused
        got = split.attend(q, k_plane, v_plane, blocks, L, positions, D ** -0.5)
        np.testing.assert_array_equal(got, one)
    np.testing.assert_allclose(got, oracle(q, k_plane, v_plane, blocks, L, positions, D ** -0.5), atol=5e-6, rtol=1e-5)


def test_workers_give_one_workers_numbers_over_an_fp8_pool(monkeypatch):
    """The FP8 KV cache's pool (e4m3 bytes, staged times the plane's scale) split over workers likewise."""
    monkeypatch.setattr(cpu_attention, "STAGE_BYTES", 3 * BLOCK_SIZE * 3 * 64 * 4)
    monkeypatch.setattr(cpu_attention, "PARALLEL_KEYS", 16)
    q, k_plane, v_plane, blocks, L, positions = case(9, 3, 64, 1500, 4, 7, 5)
    k8, v8 = (p.astype(ml_dtypes.float8_e4m3fn) for p in (k_plane, v_plane))
    args = (q, k8, v8, blocks, L, positions, 0.125, (0.5, 2.0))
    np.testing.assert_array_equal(PagedAttention(Workers(2)).attend(*args), PagedAttention().attend(*args))
    want = oracle(q, k8.astype(np.float32) * 0.5, v8.astype(np.float32) * 2.0, blocks, L, positions, 0.125)
    np.testing.assert_allclose(PagedAttention(Workers(2)).attend(*args), want, atol=2e-5, rtol=1e-4)


def test_workers_wait_for_every_part_and_raise_the_first_error():
    ended = []

    def part(w):
        if w == 0:
            raise ValueError("part 0")
        time.sleep(0.05)
        ended.append(w)

    with pytest.raises(ValueError, match="part 0"):
        Workers(3).run(part, 3)
    assert sorted(ended) == [1, 2]          # no part left running after run returns
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Workers(0)
