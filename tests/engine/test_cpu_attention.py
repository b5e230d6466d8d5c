"""NumpyOps' paged attention (engine/executor/cpu_attention.py) against the definition, written plainly in
float64: per query head, softmax(q·k^T·scale) over the keys up to the query's position, times V, with
query head h reading kv head h // G (GQA), the context gathered from scattered pool blocks."""
import numpy as np
import pytest

from engine.executor import cpu_attention
from engine.executor.cpu_attention import PagedAttention
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


@pytest.mark.parametrize("Hq,Hkv,D,L,n", [(9, 3, 64, 1500, 4), (8, 2, 32, 37, 37), (4, 4, 16, 100, 1),
                                          (6, 1, 128, 700, 20), (2, 1, 8, 16, 3), (4, 2, 16, 17, 1)])
def test_attention_matches_definition(Hq, Hkv, D, L, n, monkeypatch):
    monkeypatch.setattr(cpu_attention, "STAGE_BYTES", 3 * BLOCK_SIZE * Hkv * D * 4)   # several groups
    rng = np.random.default_rng(L + n)
    nb = -(-L // BLOCK_SIZE)
    k_plane, v_plane = (rng.standard_normal((nb + 9, BLOCK_SIZE, Hkv, D), dtype=np.float32) for _ in range(2))
    blocks = rng.permutation(nb + 9)[:nb]
    q = rng.standard_normal((n, Hq, D), dtype=np.float32) * 2
    positions = np.arange(L - n, L)
    got = PagedAttention().attend(q, k_plane, v_plane, blocks, L, positions, D ** -0.5)
    assert got.dtype == np.float32 and got.shape == (n, Hq, D)
    np.testing.assert_allclose(got, oracle(q, k_plane, v_plane, blocks, L, positions, D ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("keep_bytes", [0, 64 << 20])
def test_scores_buffer_reused_across_shapes(keep_bytes, monkeypatch):
    """One PagedAttention over calls of growing and shrinking shapes (the kept scores buffer grows, then serves
    smaller calls from its start), or with nothing kept (a new array a call): each call as the definition."""
    monkeypatch.setattr(cpu_attention, "SCORES_KEEP_BYTES", keep_bytes)
    rng = np.random.default_rng(7)
    Hq, Hkv, D = 6, 2, 16
    k_plane, v_plane = (rng.standard_normal((40, BLOCK_SIZE, Hkv, D), dtype=np.float32) for _ in range(2))
    paged = PagedAttention()
    for L, n in [(40, 3), (500, 8), (17, 1), (300, 30)]:
        blocks = rng.permutation(40)[:-(-L // BLOCK_SIZE)]
        q = rng.standard_normal((n, Hq, D), dtype=np.float32)
        positions = np.arange(L - n, L)
        got = paged.attend(q, k_plane, v_plane, blocks, L, positions, D ** -0.5)
        np.testing.assert_allclose(got, oracle(q, k_plane, v_plane, blocks, L, positions, D ** -0.5), atol=2e-6,
                                   rtol=1e-5)
