"""The fused decode op rope_attention (paged_decode.cu rope_paged_decode_attention: q/k norm + rope +
KV write + attention in one launch) against its composition (qk_norm_rope_cache.cu, then
paged_decode_attention): same output (at most 1 bf16 ulp) and the same cache, bit for bit, over group
sizes, head dims, with and without q/k norm, batch 1 and a padded batch of 7, contexts 1..4100 and
split counts 1..64. On the CPU: the ComposedOps default, and GpuOps' choice between the fused kernel
(decode-only steps) and the composition (prefill and mixed steps)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from bench.ab_switches import ABGpuOps
from engine.executor.gpu_inputs import GpuStepContext
from engine.models.ops import AttentionSpec, ComposedOps
from memory.kv_format import KVFormat
from test_raw_cuda_kernels import attention_ref, bits, dev, f32, poison, rope_ref

CONTEXTS = [1, 17, 300, 4100]
EPS = 1e-6


def decode_case(rng, D: int, Hq: int, Hkv: int, contexts: list[int], pad: int):
    """One decode token per sequence at position context − 1 (blocks shuffled over a cache of random
    keys; the new tokens' own slots poisoned), plus `pad` padding rows (position and slot −1, table
    row 0): dict of host arrays."""
    blocks = [-(-c // 16) for c in contexts]
    nblocks = sum(blocks) + 3
    perm = rng.permutation(nblocks).astype(np.int32)
    B, width = len(contexts) + pad, max(blocks)
    tables, at = np.zeros((B, width), np.int32), 0
    for i, n in enumerate(blocks):
        tables[i, :n], at = perm[at:at + n], at + n
    positions = np.array([c - 1 for c in contexts] + [-1] * pad, np.int32)
    slots = np.array([tables[i, p // 16] * 16 + p % 16 for i, p in enumerate(positions[:len(contexts)])]
                     + [-1] * pad, np.int32)
    kc = bits(rng.standard_normal((nblocks * 16, Hkv, D)))
    vc = bits(rng.standard_normal((nblocks * 16, Hkv, D)))
    kc[slots[slots >= 0]] = vc[slots[slots >= 0]] = 0x7FC1
    return dict(qkv=bits(rng.standard_normal((B, (Hq + 2 * Hkv) * D))), kc=kc, vc=vc, tables=tables,
                token_seq=np.array(list(range(len(contexts))) + [0] * pad, np.int32), positions=positions,
                slots=slots, q_norm=bits(1 + 0.2 * rng.standard_normal(D)),
                k_norm=bits(1 + 0.2 * rng.standard_normal(D)),
                inv_freq=(1.0 / (1e6 ** (np.arange(0, D, 2) / D))).astype(np.float32))


def run_decode(cp, c: dict, Hq: int, Hkv: int, D: int, splits: int, qk_norm: bool, fused: bool,
               attn_factor: float = 1.0, heads: int = 0):
    """(out, k_cache, v_cache) on the host after the fused launch or the two composed ones; heads: query
    heads per CTA (0: the whole group)."""
    from openinfer_kernels.raw_cuda import kernel

    T, G, null = len(c["positions"]), Hq // Hkv, np.uint64(0)
    heads = heads or G
    build = dict(GQA=G, HEAD_DIM=D, **({"HEADS": heads} if heads != G else {}))
    grid = (T, splits, Hkv * (G // heads))
    kc, vc = dev(cp, c["kc"]), dev(cp, c["vc"])
    out = poison(cp, (T, Hq * D))
    part_out = cp.full((T * Hq * splits * D,), np.nan, np.float32)
    part_max, part_sum = cp.full((T * Hq * splits,), np.nan, np.float32), cp.full((T * Hq * splits,), np.nan, np.float32)
    counters = cp.zeros(T * Hq, np.int32)
    norms = (dev(cp, c["q_norm"]), dev(cp, c["k_norm"])) if qk_norm else (null, null)
    qkv, inv_freq, pos, slots = dev(cp, c["qkv"]), dev(cp, c["inv_freq"]), dev(cp, c["positions"]), dev(cp, c["slots"])
    prologue = (np.float32(EPS), inv_freq, np.float32(attn_factor))
    tail = (kc, vc, dev(cp, c["tables"]), np.int32(c["tables"].shape[1]), dev(cp, c["token_seq"]), pos,
            part_out, part_max, part_sum, out, counters, np.int32(Hkv), np.float32(D ** -0.5))
    if fused:
        kernel("paged_decode", "rope_paged_decode_attention", **build)(
            grid, (128,), (qkv,) + norms + prologue + (slots,) + tail)
    else:
        q = poison(cp, (T, Hq, D))
        kernel("qk_norm_rope_cache", "qk_norm_rope_cache")(
            (T, -(-(Hq + 2 * Hkv) // 4)), (128,),
            (qkv,) + norms + prologue + (pos, slots, q, kc, vc, np.int32(Hq), np.int32(Hkv), np.int32(D)))
        kernel("paged_decode", "paged_decode_attention", **build)(grid, (128,), (q,) + tail)
    assert not counters.get().any()                       # the split tickets are back at zero
    return out.get(), kc.get(), vc.get()


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in bf16 ulps between two arrays of bf16 bits (signs folded onto one integer line)."""
    def line(u):
        u = u.astype(np.int64)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)
    return np.abs(line(a) - line(b))


@pytest.mark.gpu
@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (8, 128), (4, 64), (8, 64), (1, 128)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("batch", [1, 7])
def test_rope_attention_equals_composed(G, D, qk_norm, batch):
    import cupy as cp

    Hkv = 2
    Hq = G * Hkv
    rng = np.random.default_rng(G * 1000 + D + qk_norm * 7 + batch)
    cases = [[c] for c in CONTEXTS] if batch == 1 else [[4100, 300, 17, 1, 300]]   # batch 7: + 2 padding rows
    for contexts in cases:
        c = decode_case(rng, D, Hq, Hkv, contexts, pad=batch - len(contexts))
        for splits in (1, 3, 16, 64):
            factor = 1.0 if splits != 3 else 1.25                                  # a yarn-style scale
            ref = run_decode(cp, c, Hq, Hkv, D, splits, qk_norm, fused=False, attn_factor=factor)
            got = run_decode(cp, c, Hq, Hkv, D, splits, qk_norm, fused=True, attn_factor=factor)
            what = f"contexts {contexts}, {splits} splits"
            assert (got[0] != 0x7FC1).all(), what                                   # every row written
            assert ulps(got[0], ref[0]).max() <= 1, what
            np.testing.assert_array_equal(got[1], ref[1], err_msg=f"k cache, {what}")
            np.testing.assert_array_equal(got[2], ref[2], err_msg=f"v cache, {what}")
        pad_rows = c["positions"] < 0
        assert not f32(got[0][pad_rows]).any()                                      # padding: zeros


@pytest.mark.gpu
@pytest.mark.parametrize("G,heads", [(8, 4), (8, 2), (8, 1), (4, 2), (4, 1), (2, 1)])
@pytest.mark.parametrize("fused", [True, False])
def test_fewer_heads_per_cta_same_bits(G, heads, fused):
    """A head group split over G/heads CTAs (small grids) runs each head's arithmetic unchanged: output,
    K and V cache bit-identical to one CTA per KV head, at 1 and many splits, with padding rows."""
    import cupy as cp

    D, Hkv = 128, 2
    rng = np.random.default_rng(G * 10 + heads + fused)
    c = decode_case(rng, D, G * Hkv, Hkv, [4100, 300, 17, 1, 129], pad=2)
    for splits in (1, 5, 64):
        ref = run_decode(cp, c, G * Hkv, Hkv, D, splits, True, fused)
        got = run_decode(cp, c, G * Hkv, Hkv, D, splits, True, fused, heads=heads)
        for a, b, what in zip(got, ref, ("out", "k cache", "v cache")):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}, {splits} splits, {heads} heads per CTA")


@pytest.mark.gpu
def test_rope_attention_matches_numpy():
    """The fused kernel against a float reference: norm, rope, then attention over the cache with the
    new key and value in place."""
    import cupy as cp

    G, D, Hkv = 4, 128, 2
    Hq = G * Hkv
    rng = np.random.default_rng(11)
    c = decode_case(rng, D, Hq, Hkv, [300, 17, 1], pad=1)
    out, kc, vc = run_decode(cp, c, Hq, Hkv, D, 5, True, fused=True)
    x, live = f32(c["qkv"]), c["slots"] >= 0
    T = len(c["positions"])
    rb = lambda a: f32(bits(a))                                                     # noqa: E731
    norm = lambda a, w: rb(f32(w) * rb(a / np.sqrt(np.mean(a * a, -1, keepdims=True) + EPS)))  # noqa: E731
    pos = np.maximum(c["positions"], 0)
    q = rb(rope_ref(norm(x[:, :Hq * D].reshape(T, Hq, D), c["q_norm"]), pos, c["inv_freq"]))
    k = rope_ref(norm(x[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D), c["k_norm"]), pos, c["inv_freq"])
    v = x[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    np.testing.assert_allclose(f32(kc[c["slots"][live]]), k[live], atol=2e-2, rtol=1e-2)
    np.testing.assert_array_equal(vc[c["slots"][live]], bits(v[live]))
    ref = attention_ref(q, f32(kc), f32(vc), c["tables"], c["token_seq"], c["positions"], D ** -0.5, G)
    np.testing.assert_allclose(f32(out), ref, atol=1.5e-2, rtol=1e-2)


# ---- CPU: the kernel's split ownership, the composition, and the routing -----------------------
def test_exactly_one_split_owns_the_new_key():
    """paged_decode.cu's split ranges (per_split rounded up to 16 keys): for every context and split
    count, the splits tile [0, ctx) and exactly one, the one whose range ends at ctx (`start < end &&
    end == ctx`), holds position ctx − 1; no other split reads it. Padding (ctx 0) has no owner."""
    for S in (1, 2, 3, 5, 16, 33, 64):
        for ctx in range(0, 700):
            per_split = ((ctx + S - 1) // S + 15) // 16 * 16
            ranges = [(sp * per_split, min(ctx, sp * per_split + per_split)) for sp in range(S)]
            owners = [sp for sp, (a, b) in enumerate(ranges) if a < b and b == ctx]
            covered = [p for a, b in ranges for p in range(a, b)]
            assert covered == list(range(ctx)), (S, ctx)
            assert owners == ([] if ctx == 0 else [sp for sp, (a, b) in enumerate(ranges) if a <= ctx - 1 < b])
            assert len(owners) == (ctx > 0), (S, ctx)


SPEC = AttentionSpec(layer=0, num_heads=8, num_kv_heads=2, head_dim=64, rms_eps=EPS, scale=0.125)


class RecordingOps(ComposedOps):
    def __init__(self):
        self.calls = []

    def qkv_rope_cache(self, qkv, spec, ctx, q_norm=None, k_norm=None):
        self.calls.append(("qkv_rope_cache", qkv, spec, ctx, q_norm, k_norm))
        return "q"

    def attention(self, q, spec, ctx):
        self.calls.append(("attention", q, spec, ctx))
        return "o"


def test_composed_rope_attention_is_rope_then_attention():
    ops = RecordingOps()
    assert ops.rope_attention("qkv", SPEC, "ctx", q_norm="qn", k_norm="kn") == "o"
    assert ops.calls == [("qkv_rope_cache", "qkv", SPEC, "ctx", "qn", "kn"), ("attention", "q", SPEC, "ctx")]


def test_numpy_ops_use_the_composition():
    from engine.executor.cpu_ops import NumpyOps
    assert NumpyOps.rope_attention is ComposedOps.rope_attention


def step_context(lens: list[int], pad_to: int | None = None):
    """A GpuStepContext over host arrays shaped as the executor builds them (decode graphs pad the
    rows of a one-token-per-sequence step to pad_to)."""
    seqs = [SeqStep(seq_id=i, token_ids=[1] * n, start_pos=5, block_table=[i], sample=True)
            for i, n in enumerate(lens)]
    b = ModelBatch.build(seqs)
    rows = pad_to or len(seqs)
    T = pad_to or b.num_tokens
    tables = np.zeros((rows, b.block_tables.shape[1]), np.int32)
    return GpuStepContext(num_tokens=T, input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                          slot_mapping=np.zeros(T, np.int32), token_seq=np.zeros(T, np.int32),
                          block_tables=tables, sample_rows=np.zeros(T, np.int32), num_splits=4)


class GpuOpsProbe(ABGpuOps):
    """GpuOps' routing on the CPU (with bench/ab_switches.py's fused_rope switch): host stand-ins for its
    buffers, kernels as names, launches and the composed ops recorded."""

    def __init__(self, fast_attention: bool, head_dim: int = 64, num_heads: int = 8):
        self.calls = []
        self.fast_attention, self.head_dim, self.num_heads = fast_attention, head_dim, num_heads
        self.fused_rope = True
        self._decode_kernels = {}
        self.shared = SimpleNamespace(num_sms=132, kv_cache=np.zeros((1, 2, 16, 2, head_dim), np.uint16),  # H200
                                      inv_freq=np.zeros(1), attention_factor=1.0, kv_format=KVFormat(),
                                      kv_scales=lambda layer: ())   # bf16: no scale arguments
        self.part_out = self.part_max = self.part_sum = np.zeros(1 << 12, np.float32)
        self.split_counters = np.zeros(64, np.int32)

    qkv_rope_cache, attention = RecordingOps.qkv_rope_cache, RecordingOps.attention

    def _out(self, rows, cols):
        return np.zeros((rows, cols), np.uint16)

    def _launch(self, k, grid, block, args):
        self.calls.append(("launch", k, grid))


@pytest.mark.parametrize("lens,pad_to,fast,fused,heads", [
    ([1], None, True, True, 2),              # batch-1 decode: 2 (token, KV head) rows, 2 heads a CTA
    ([1, 1, 1], 8, True, True, 2),           # a decode graph: 3 sequences padded to 8 rows (16 rows < 132 / 4)
    ([1] * 20, None, True, True, 4),         # 40 rows: a quarter of the SMs and more, whole groups
    ([1] * 16, None, True, True, 2),         # 32 rows: under a quarter of 132
    ([1, 1, 1], None, False, False, 0),      # the decode kernel switched off
    ([1, 1], None, "no rope", False, 0),     # the fused path switched off (bench A/B)
    ([1] * 20, 64, True, False, 0),          # 4 splits x 2 KV heads x 64 rows: over FUSED_ROPE_MAX_CTAS
    ([4], None, True, False, 0),             # a prefill chunk: later tokens read earlier tokens' keys
    ([1, 3, 1], None, True, False, 0),       # a mixed step
])
def test_gpu_rope_attention_routing(monkeypatch, lens, pad_to, fast, fused, heads):
    from engine.executor import gpu_ops

    monkeypatch.setattr(gpu_ops, "kernel", lambda name, entry, **defines: (name, entry, tuple(sorted(defines.items()))))
    ops = GpuOpsProbe(fast_attention=bool(fast))
    ops.fused_rope = fast != "no rope"
    ctx = step_context(lens, pad_to)
    assert ctx.decode_only == (max(lens) == 1)
    out = ops.rope_attention("qkv", SPEC, ctx, q_norm="qn", k_norm="kn")
    if fused:
        defines = (("GQA", 4),) + ((("HEADS", heads),) if heads != 4 else ()) + (("HEAD_DIM", 64),)
        entry = ("paged_decode", "rope_paged_decode_attention", defines)
        assert ops.calls == [("launch", entry, (ctx.num_tokens, 4, 2 * 4 // heads))]
        assert out.shape == (ctx.num_tokens, 8 * 64)
    else:
        assert [c[0] for c in ops.calls] == ["qkv_rope_cache", "attention"] and out == "o"


def test_gpu_rope_attention_other_head_dim_composes(monkeypatch):
    """A layer whose shape differs from the model's compiled decode kernel falls back to the composition."""
    from engine.executor import gpu_ops

    monkeypatch.setattr(gpu_ops, "kernel", lambda name, entry, **defines: (name, entry))
    ops = GpuOpsProbe(fast_attention=True, head_dim=128)
    ops.rope_attention("qkv", SPEC, step_context([1, 1]))
    assert [c[0] for c in ops.calls] == ["qkv_rope_cache", "attention"]
