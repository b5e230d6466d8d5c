"""The GPU sampler against engine/sampling.py (the host reference) on the same logits."""
from __future__ import annotations

import numpy as np
import pytest

from engine.batch import SeqStep
from engine.request import SamplingParams
from engine.sampling import filtered_probs, processed_logits, sample_step

pytestmark = pytest.mark.gpu
V = 151936


def make_seqs(rng, n):
    seqs = []
    for i in range(n):
        kind = i % 8
        hist = rng.integers(0, 5000, 40).tolist()
        p = SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][(i + i // 8) % 4], seed=1000 + i,
                           logprobs=[None, 0, 5, 20][i % 4])
        if kind == 1:
            p.top_k = 50
        if kind == 2:
            p.top_p = 0.8
        if kind == 3:
            p.min_p = 0.05
        if kind == 4:
            p.top_k, p.top_p, p.min_p = 200, 0.9, 0.01
        if kind == 5:
            p.repetition_penalty, p.frequency_penalty, p.presence_penalty = 1.3, 0.5, 0.4
        if kind == 6:
            p.logit_bias = {int(rng.integers(V)): 5.0, 3: -100.0}
            p.min_tokens, p.stop_token_ids = 10, [7, 8]
        seqs.append(SeqStep(seq_id=i, token_ids=[hist[-1]], start_pos=39, block_table=[0, 1, 2], sample=True,
                            params=p, prompt_len=30, history=hist, num_generated=5 + i))
    return seqs


def test_gpu_sampler_matches_reference():
    import cupy
    from engine.executor.gpu_sampler import GpuSampler
    from memory.device_arena import DeviceArena

    rng = np.random.default_rng(0)
    n = 64
    logits = (2.5 * rng.standard_normal((n, V))).astype(np.float32)
    seqs = make_seqs(rng, n)
    arena = DeviceArena(1 << 30)
    stream = cupy.cuda.Stream(non_blocking=True)
    sampler = GpuSampler(arena, n, V, stream)
    device_logits = cupy.asarray(logits)
    cupy.cuda.Device().synchronize()      # the upload ran on CuPy's default stream
    got = sampler.sample(device_logits, seqs)
    ref = sample_step(logits, seqs)
    same = [g.token_id == r.token_id for g, r in zip(got, ref)]
    assert sum(same) >= n - 1, [(i, g.token_id, r.token_id) for i, (g, r) in enumerate(zip(got, ref)) if g.token_id != r.token_id]
    # Processed logits (bias, mask, penalties) match the reference exactly where it applied them.
    proc = sampler.processed[:n].get()
    for i in (5, 6, 13, 14):
        want = processed_logits(logits[i], seqs[i].params, seqs[i].history, seqs[i].prompt_len, seqs[i].num_generated)
        np.testing.assert_allclose(proc[i], want, rtol=1e-6, atol=1e-6)
    # The kept support after temperature / min_p / top_k / top_p is the reference's, among tokens that
    # can be drawn at all (p >= 1e-20: a logit_bias of -100 leaves a float32-denormal probability the
    # GPU flushes and numpy keeps; neither can ever be drawn by a double-precision u).
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    probs = sampler.probs[:len(sampled)].get()
    for b, i in enumerate(sampled):
        src = proc[i] if i % 8 in (5, 6) else logits[i]
        want = filtered_probs(src, seqs[i].params)
        assert set(np.flatnonzero(probs[b] >= 1e-20)) == set(np.flatnonzero(want >= 1e-20)), f"row {i} ({seqs[i].params})"
    for g, r in zip(got, ref):
        assert (g.logprob is None) == (r.logprob is None)
        if r.logprob is not None and g.token_id == r.token_id:
            assert abs(g.logprob - r.logprob) < 1e-3
            assert [t for t, _ in g.top_logprobs] == [t for t, _ in r.top_logprobs]
            np.testing.assert_allclose([v for _, v in g.top_logprobs], [v for _, v in r.top_logprobs], atol=1e-3)
    arena.close()


def test_seeded_draws_follow_the_distribution():
    """Many seeds on one row: the empirical distribution of GPU draws matches the filtered probs."""
    import cupy
    from engine.executor.gpu_sampler import GpuSampler
    from memory.device_arena import DeviceArena

    row = np.full(V, -30.0, np.float32)
    row[:6] = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5]
    n = 256
    seqs = [SeqStep(seq_id=i, token_ids=[1], start_pos=0, block_table=[0], sample=True,
                    params=SamplingParams(temperature=1.0, top_k=5, seed=i)) for i in range(n)]
    arena = DeviceArena(1 << 30)
    sampler = GpuSampler(arena, n, V, cupy.cuda.Stream(non_blocking=True))
    device_logits = cupy.asarray(np.tile(row, (n, 1)))
    cupy.cuda.Device().synchronize()
    got = [t.token_id for t in sampler.sample(device_logits, seqs)]
    ref = [t.token_id for t in sample_step(np.tile(row, (n, 1)), seqs)]
    assert got == ref
    assert set(got) <= set(range(5))
    arena.close()


def test_split_argmax_and_per_row_topk():
    """sampler.argmax splits rows over ARGMAX_CHUNKS CTAs up to ARGMAX_SPLIT_ROWS rows: the same ids as
    numpy (ties -> lowest id, planted across chunk borders) and as the one-CTA kernel, the logsumexp
    within float rounding, the same results when run again (the ticket counters reset). The per-row
    top-k kernel gives, for each row's own k, exactly the fixed-k kernel's first k entries."""
    import cupy
    from engine.executor.gpu_sampler import ARGMAX_CHUNKS, ARGMAX_SPLIT_ROWS, MAX_TOP_LOGPROBS, GpuSampler
    from memory.device_arena import DeviceArena

    rng = np.random.default_rng(4)
    arena = DeviceArena(1 << 30)
    stream = cupy.cuda.Stream(non_blocking=True)
    n = ARGMAX_SPLIT_ROWS + 1
    sampler = GpuSampler(arena, n, V, stream)
    chunk = -(-V // ARGMAX_CHUNKS)
    x = (3.0 * rng.standard_normal((n, V))).astype(np.float32)
    x[1, [chunk * 5 + 7, chunk * 2 + 3, chunk * 9]] = 50.0         # a three-way tie in three chunks
    x[2, :] = -1.5                                                  # all equal: id 0
    x[3, [chunk - 1, chunk]] = 40.0                                 # a tie straddling a chunk border
    x[4, V - 1] = 60.0                                              # the best in the last, short chunk
    dx = cupy.asarray(x)
    cupy.cuda.Device().synchronize()
    x64 = x.astype(np.float64)
    lse_ref = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
    null = np.uint64(0)

    def fetch(a):
        out = a.get(stream=stream)
        stream.synchronize()
        return out

    for S in (1, 5, ARGMAX_SPLIT_ROWS):
        for _ in range(2):
            with stream:
                sampler.ids.fill(-1)
            sampler.argmax(dx, S)
            ids, lse = fetch(sampler.ids[:S]), fetch(sampler.lse[:S])
            np.testing.assert_array_equal(ids, x[:S].argmax(1))
            np.testing.assert_allclose(lse, lse_ref[:S], rtol=2e-6)
        assert int(fetch(sampler.tickets).max()) == 0
    sampler.k_argmax((n,), (1024,), (dx, np.int32(V), null, sampler.ids, null, sampler.lse), stream=stream)
    single = fetch(sampler.ids[:ARGMAX_SPLIT_ROWS])
    sampler.argmax(dx, ARGMAX_SPLIT_ROWS)
    np.testing.assert_array_equal(fetch(sampler.ids[:ARGMAX_SPLIT_ROWS]), single)

    ks = rng.integers(0, MAX_TOP_LOGPROBS + 1, n).astype(np.int32)
    ks[:3] = [0, MAX_TOP_LOGPROBS, 1]
    sampler.k_topk((n,), (1024,), (dx, np.int32(V), np.int32(MAX_TOP_LOGPROBS), sampler.lse, sampler.top_ids,
                                   sampler.top_lp), stream=stream)
    full_ids, full_lp = fetch(sampler.top_ids[:n]), fetch(sampler.top_lp[:n])
    with stream:
        sampler.top_ids.fill(-7)
        dks = cupy.asarray(ks)
    sampler.k_topk_each((n,), (1024,), (dx, np.int32(V), np.int32(MAX_TOP_LOGPROBS), dks, sampler.lse,
                                        sampler.top_ids, sampler.top_lp), stream=stream)
    each_ids, each_lp = fetch(sampler.top_ids[:n]), fetch(sampler.top_lp[:n])
    for r, k in enumerate(ks):
        np.testing.assert_array_equal(each_ids[r, :k], full_ids[r, :k])
        np.testing.assert_array_equal(each_lp[r, :k], full_lp[r, :k])
        assert (each_ids[r, k:] == -7).all(), f"row {r} wrote past its k={k}"
    arena.close()


def test_device_seeded_uniforms_are_numpy_default_rng():
    """seeded_uniforms on the GPU: default_rng([seed, step]).random() bit for bit where the host marked
    the row (uniform < 0); a row the host drew keeps its value."""
    import cupy
    from openinfer_kernels.raw_cuda import kernel

    rng = np.random.default_rng(11)
    n = 4096
    seeds, steps = rng.integers(0, 2**32, n, dtype=np.uint64), rng.integers(0, 2**32, n, dtype=np.uint64)
    seeds[:3], steps[:3] = [0, 2**32 - 1, 7], [0, 2**32 - 1, 0]
    uniform = np.full(n, -1.0)
    uniform[5] = 0.25
    d_seed, d_step = cupy.asarray(seeds.astype(np.uint32)), cupy.asarray(steps.astype(np.uint32))
    d_u = cupy.asarray(uniform)
    kernel("sampling", "seeded_uniforms")((-(-n // 128),), (128,), (d_seed, d_step, d_u, np.int32(n)))
    got = d_u.get()
    want = np.array([np.random.default_rng([int(a), int(b)]).random() for a, b in zip(seeds, steps)])
    want[5] = 0.25
    np.testing.assert_array_equal(got, want)
