"""The CuTe prefill attention path (engine/executor/gpu_prefill.py) on the CPU: the switch, the plan
(which sequences a launch serves, its cu_q / cu_k / tile list, the paged kernel's positions), GpuOps'
routing, and the whole path with numpy stand-ins for the two kernels (gather, causal varlen attention
with query rows aligned to the end of the keys) against a direct numpy attention over the paged cache.
The same path on the GPU, against the paged kernel and HF: tests/gpu/test_gpu_prefill_gpu.py."""
from __future__ import annotations

import types

import numpy as np
import pytest

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep
from engine.executor import gpu_prefill
from engine.executor.options import gpu_tuning_from_env
from engine.executor.gpu_inputs import GpuStepContext
from engine.executor.gpu_ops import GpuOps
from engine.executor.gpu_prefill import (DEFAULT_MIN_QUERY, PrefillStep, parse_prefill_attention, plan_prefill,
                                         prefill_min_query, upload_entries)
from engine.models.ops import AttentionSpec
from memory.kv_format import KVFormat
from openinfer_kernels.cute.attention import attention_work


def mixed_batch(rng, steps: list[tuple[int, int]], spare_blocks: int = 5) -> ModelBatch:
    """(start_pos, new tokens) per sequence, block tables drawn from one shuffled pool."""
    need = [-(-(s + n) // BLOCK_SIZE) for s, n in steps]
    pool = rng.permutation(sum(need) + spare_blocks).tolist()
    seqs = []
    for i, ((start, n), k) in enumerate(zip(steps, need)):
        seqs.append(SeqStep(seq_id=i, token_ids=[1] * n, start_pos=start, block_table=pool[:k], sample=True))
        pool = pool[k:]
    return ModelBatch.build(seqs)


# A 1-token decode, a long prompt, a short chunk, a chunk after a cached prefix that ends mid-block.
MIXED = [(499, 1), (0, 300), (0, 20), (203, 150)]


# ---- the switch --------------------------------------------------------------------------------
def test_parse_prefill_attention():
    assert parse_prefill_attention("cute") == DEFAULT_MIN_QUERY
    assert parse_prefill_attention(" CUTE:8 ") == 8
    assert parse_prefill_attention("paged") is None
    for bad in ("cute:0", "cute:x", "flash"):
        with pytest.raises(ValueError, match="prefill attention"):
            parse_prefill_attention(bad)


def test_prefill_min_query_needs_the_library_and_head_dim(monkeypatch):
    import openinfer_kernels.cute as cute

    monkeypatch.setattr(cute, "available", lambda: cute.Availability(True))
    assert prefill_min_query("cute:5", 128) == 5
    assert prefill_min_query("cute", 64) == DEFAULT_MIN_QUERY
    assert prefill_min_query("cute", 96) is None                  # no CuTe kernel for head_dim 96
    assert prefill_min_query("paged", 128) is None
    env = gpu_tuning_from_env({"OPENINFER_PREFILL_ATTENTION": "cute:3"}).prefill_attention
    assert prefill_min_query(env, 128) == 3
    assert prefill_min_query(gpu_tuning_from_env({"OPENINFER_PREFILL_ATTENTION": "paged"}).prefill_attention,
                             128) is None
    monkeypatch.setattr(cute, "available", lambda: cute.Availability(False, "no library"))
    assert prefill_min_query("cute", 128) is None


# ---- the plan ----------------------------------------------------------------------------------
def test_plan_serves_long_sequences_and_leaves_the_rest_paged():
    b = mixed_batch(np.random.default_rng(0), MIXED)
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, min_query=16, max_key_rows=4096)
    # seqs 1, 2, 3 (300, 20, 150 new tokens) form one launch; the decode (seq 0) stays paged
    assert [(a.first_seq, a.num_seqs) for a in plan.launches] == [(1, 3)]
    a = plan.launches[0]
    assert a.q_rows == (1, 471)
    np.testing.assert_array_equal(plan.data[a.cu_q:a.cu_q + 4], [0, 300, 320, 470])
    np.testing.assert_array_equal(plan.data[a.cu_k:a.cu_k + 4], [0, 300, 320, 673])
    assert a.key_rows == 673 and a.key_blocks == -(-353 // 16)
    work = plan.data[a.work:a.work + 2 * a.tiles].reshape(a.tiles, 2)
    np.testing.assert_array_equal(work, attention_work(np.array([0, 300, 320, 470])))
    assert all(off % gpu_prefill.ALIGN == 0 for off in (a.cu_q, a.cu_k, a.work, plan.paged_positions))
    paged = plan.data[plan.paged_positions:plan.paged_positions + b.num_tokens]
    np.testing.assert_array_equal(paged, np.r_[499, np.full(470, -1)])
    assert plan.data.size <= upload_entries(max_tokens=b.num_tokens, max_seqs=4)


def test_plan_splits_launches_at_unserved_sequences_and_the_scratch():
    b = mixed_batch(np.random.default_rng(1), MIXED)
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, min_query=32, max_key_rows=4096)
    assert [(a.first_seq, a.num_seqs, a.q_rows) for a in plan.launches] == [(1, 1, (1, 301)), (3, 1, (321, 471))]
    paged = plan.data[plan.paged_positions:plan.paged_positions + b.num_tokens]
    assert (paged[1:301] == -1).all() and (paged[321:] == -1).all()
    np.testing.assert_array_equal(paged[301:321], b.positions[301:321])
    # every sequence served, but only 400 gathered rows fit: the contexts 500 / 300 / 20 / 353
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, min_query=1, max_key_rows=400)
    assert [(a.first_seq, a.num_seqs, a.key_rows) for a in plan.launches] == [(1, 2, 320), (3, 1, 353)]
    assert plan.paged_positions is not None                        # the 500-key decode does not fit
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, min_query=1, max_key_rows=2000)
    assert [(a.first_seq, a.num_seqs) for a in plan.launches] == [(0, 4)] and plan.paged_positions is None


def test_plan_none_without_a_long_sequence():
    b = mixed_batch(np.random.default_rng(2), [(40, 1), (0, 20), (7, 63)])
    assert plan_prefill(b.cu_seqlens, b.context_lens, b.positions, 64, 4096) is None


def test_decode_only_steps_are_never_planned():
    own = types.SimpleNamespace(min_query=1, key_rows=4096)
    b = mixed_batch(np.random.default_rng(3), [(40, 1), (9, 1)])
    assert gpu_prefill.PrefillAttention.step(own, b) is None
    own.min_query = None                                           # switched off at run time
    assert gpu_prefill.PrefillAttention.step(own, mixed_batch(np.random.default_rng(3), MIXED)) is None


# ---- routing and the whole path with numpy kernels ---------------------------------------------
def spec_for(D: int, Hq: int = 8, Hkv: int = 2, scale: float | None = None) -> AttentionSpec:
    return AttentionSpec(layer=0, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, rms_eps=1e-6,
                         scale=D ** -0.5 if scale is None else scale)


def test_serves_only_the_kernels_head_dims_and_scale():
    assert PrefillStep.cute_serves(spec_for(128)) and PrefillStep.cute_serves(spec_for(64))
    assert not PrefillStep.cute_serves(spec_for(32))
    assert not PrefillStep.cute_serves(spec_for(128, scale=0.1))


def token_seqs(batch: ModelBatch) -> np.ndarray:
    return np.repeat(np.arange(len(batch.seqs)), np.diff(batch.cu_seqlens)).astype(np.int32)


def causal_ref(q, kc, vc, batch: ModelBatch, G: int, rows=None, seq=None, positions=None) -> np.ndarray:
    """Attention of each token over positions [0, position] of its sequence, read through the tables
    (``seq`` / ``positions``: each query row's sequence and position, default the batch's)."""
    T, Hq, D = q.shape
    out = np.zeros((T, Hq * D), np.float32)
    seq = token_seqs(batch) if seq is None else seq
    positions = batch.positions if positions is None else positions
    for t in range(T) if rows is None else rows:
        p = np.arange(positions[t] + 1)
        slots = batch.block_tables[seq[t]][p // 16] * 16 + p % 16
        for h in range(Hq):
            s = kc[slots, h // G] @ q[t, h] * D ** -0.5
            w = np.exp(s - s.max())
            out[t, h * D:(h + 1) * D] = w / w.sum() @ vc[slots, h // G]
    return out


def numpy_gather(kernel, grid, block, args, stream):
    kc, vc, tables, width, cu_k, k_out, v_out, row_vecs = args
    assert grid[1] == cu_k.size - 1 and tables.shape[1] == width
    for b in range(grid[1]):
        for p in range(cu_k[b + 1] - cu_k[b]):
            assert p // 16 < grid[0]
            k_out[cu_k[b] + p] = kc[tables[b, p // 16] * 16 + p % 16]
            v_out[cu_k[b] + p] = vc[tables[b, p // 16] * 16 + p % 16]


def numpy_varlen(q, k, v, o, cu_q, cu_k, work, stream=None):
    Hq, D, G = q.shape[1], q.shape[2], q.shape[1] // k.shape[1]
    assert sorted(map(tuple, work.tolist())) == sorted(map(tuple, attention_work(cu_q).tolist()))
    for b in range(cu_q.size - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for i in range(lq):
            keys = np.arange(cu_k[b], cu_k[b] + lk - lq + i + 1)
            for h in range(Hq):
                s = k[keys, h // G] @ q[cu_q[b] + i, h] * D ** -0.5
                w = np.exp(s - s.max())
                o[cu_q[b] + i, h] = w / w.sum() @ v[keys, h // G]


class PagedStandIn(GpuOps):
    """GpuOps with the paged kernel replaced by numpy (rows with position < 0 give zeros)."""

    def __init__(self, kv_cache, batch, G):
        self.batch, self.G, self.paged_calls = batch, G, []
        self.shared = types.SimpleNamespace(kv_cache=kv_cache, num_sms=132, max_tokens=0, kv_format=KVFormat(),
                                            kv_entry="", kv_scales=lambda layer: ())
        self.head_dim = kv_cache.shape[-1]
        self.num_heads, self.fast_attention = kv_cache.shape[-2] * G, True
        self.part_out = self.part_max = self.part_sum = self.split_counters = None

    def _out(self, rows, cols):
        return np.full((rows, cols), np.nan, np.float32)

    def _check_attention(self, spec, ctx):
        self.paged_calls.append(ctx.positions.copy())

    def _decode_kernel(self, num_kv_heads, entry="paged_decode_attention", heads=0):
        return "paged"

    def _launch(self, k, grid, block, args):
        q, token_seq, positions, out = args[0], args[5], args[6], args[10]
        assert grid[0] == q.shape[0] == positions.shape[0] == token_seq.shape[0] == out.shape[0]
        rows = np.flatnonzero(positions >= 0)
        out[:] = 0
        out[rows] = causal_ref(q, self.shared.kv_cache[0, 0], self.shared.kv_cache[0, 1], self.batch, self.G, rows,
                               seq=token_seq, positions=positions)[rows]


@pytest.mark.parametrize("min_query,max_key_rows,launches,paged", [
    (16, 4096, 1, True), (32, 4096, 2, True), (1, 4096, 1, False), (1, 400, 2, True)])
def test_prefill_path_with_numpy_kernels(monkeypatch, min_query, max_key_rows, launches, paged):
    import openinfer_kernels.cute as cute

    for module in ("gpu_prefill", "gpu_chunk"):
        monkeypatch.setattr(f"engine.executor.{module}.launch", numpy_gather)
    monkeypatch.setattr(cute, "varlen_attention", numpy_varlen)
    rng = np.random.default_rng(min_query + max_key_rows)
    b = mixed_batch(rng, MIXED)
    D, Hq, Hkv = 16 * 4, 4, 2
    slots = (int(b.block_tables.max()) + 1) * 16
    kv = rng.standard_normal((1, 2, slots, Hkv, D)).astype(np.float32)
    q = rng.standard_normal((b.num_tokens, Hq, D)).astype(np.float32)
    plan = plan_prefill(b.cu_seqlens, b.context_lens, b.positions, min_query, max_key_rows)
    assert len(plan.launches) == launches and (plan.paged_positions is not None) == paged
    rows = max_key_rows
    own = types.SimpleNamespace(data=plan.data, stream=None, gather="kv_gather", launches=0, chunk=None,
                                k=np.full((rows, Hkv, D), np.nan, np.float32), v=np.full((rows, Hkv, D), np.nan, np.float32))
    ops = PagedStandIn(kv, b, Hq // Hkv)
    step = PrefillStep(own, plan)
    T = b.num_tokens
    ctx = GpuStepContext(num_tokens=T, input_ids=b.input_ids, positions=b.positions, slot_mapping=b.slot_mapping,
                         token_seq=token_seqs(b), block_tables=b.block_tables, sample_rows=None, num_splits=1,
                         prefill=step)
    out = ops.attention(q, spec_for(D, Hq, Hkv), ctx)
    assert own.launches == launches and len(ops.paged_calls) == int(paged)
    if paged:          # the paged kernel ran over the span of the rows it serves, not the whole step
        r0, r1 = plan.paged_rows
        unserved = np.flatnonzero(plan.data[plan.paged_positions:plan.paged_positions + T] >= 0)
        assert (r0, r1) == (unserved[0], unserved[-1] + 1) and ops.paged_calls[0].shape[0] == r1 - r0 < T
    np.testing.assert_allclose(out, causal_ref(q, kv[0, 0], kv[0, 1], b, Hq // Hkv), atol=1e-5, rtol=1e-5)


def test_attention_routes_unserved_layers_to_the_paged_kernel():
    b = mixed_batch(np.random.default_rng(4), [(0, 40)])
    served = types.SimpleNamespace(serves=lambda spec: False, attention=None)
    ops = PagedStandIn(np.ones((1, 2, 128, 2, 32), np.float32), b, 4)
    ctx = GpuStepContext(num_tokens=40, input_ids=None, positions=b.positions, slot_mapping=None,
                         token_seq=token_seqs(b), block_tables=b.block_tables, sample_rows=None, num_splits=1,
                         prefill=served)
    ops.attention(np.ones((40, 8, 32), np.float32), spec_for(32), ctx)
    assert len(ops.paged_calls) == 1


# ---- the plan's upload under async scheduling ---------------------------------------------------
class _LaggingDevice:
    """A stand-in for CuPy's runtime whose host-to-device copies run only when the host waits for them (an
    event's synchronize) or the test says: a device still busy with earlier work. Each copy reads its pinned
    source when it runs, as the copy engine would."""

    def __init__(self):
        self.queued, self.done = [], []
        self.memcpyHostToDevice = 1
        device = self

        class Event:
            def __init__(self, **kwargs):
                self.at = 0

            def record(self, stream):
                self.at = len(device.queued) + len(device.done)

            def synchronize(self):
                device.run_copies(self.at - len(device.done))

        self.Event = Event

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        self.queued.append((dst, src, nbytes))

    def run_copies(self, count: int | None = None) -> list[np.ndarray]:
        import ctypes
        count = len(self.queued) if count is None else max(0, count)
        for _, src, nbytes in self.queued[:count]:
            self.done.append(np.frombuffer(ctypes.string_at(src, nbytes), np.int32).copy())
        del self.queued[:count]
        return self.done


def test_queued_steps_plans_never_overwrite_one_still_waiting_for_its_upload(monkeypatch):
    """Async scheduling plans and uploads eager steps while the ones before may still wait in the stream (on a
    loaded GPU, behind earlier kernels; a prefill chunk that samples nothing returns without waiting for the
    GPU, so three or more can be queued): every queued copy must still read its own step's plan. (With one
    pinned buffer, or two used blindly in turn, a copy read a later step's plan: garbage attention for chunked
    prefill under load, then an illegal address.)"""
    import sys

    import memory.streams

    runtime = _LaggingDevice()
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Event=runtime.Event))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(memory.streams, "pinned_array", lambda shape, dtype: np.zeros(shape, dtype))
    monkeypatch.setattr(gpu_prefill, "kernel", lambda *a, **k: None)

    class Arena:
        def take_all(self, prefix, buffers):
            return {b.name: types.SimpleNamespace(shape=b.shape, size=int(np.prod(b.shape)),
                                                  data=types.SimpleNamespace(ptr=0)) for b in buffers}

    pa = gpu_prefill.PrefillAttention(Arena(), types.SimpleNamespace(ptr=0), max_tokens=512, max_seqs=8,
                                      key_rows=1024, num_kv_heads=2, head_dim=64, min_query=16)
    rng = np.random.default_rng(3)
    steps = [mixed_batch(rng, [(0, 40), (0, 33)]), mixed_batch(rng, [(16, 60)]), mixed_batch(rng, [(0, 17)]),
             mixed_batch(rng, [(32, 48), (5, 20)])]
    plans = [pa.step(b).plan.data.copy() for b in steps]            # none of the copies has run yet
    got = runtime.run_copies()
    assert len(got) == len(plans)
    for want, copied in zip(plans, got):
        np.testing.assert_array_equal(copied, want)
