"""DeepSeek-V4's compressor on the device (dsv4_compress.cu through GpuDSV4Ops: compress_windows and store_ring over a
step's token rows as gpu_dsv4_ops.device_attention hands them over, step_rows' per-token arguments) against the
definition (cpu_dsv4_attention.compress_windows over each closing window's inputs, taken by position from the
sequence's own inputs), in the compact cache's layout: the inputs of positions
at or past a sequence's first position in the step are the step's float32 rows, earlier ones the bf16 values its
ring holds. Shared by the host emulation (tests/kernels/test_dsv4_compress_emulated.py) and the device test
(tests/gpu/test_gpu_dsv4_compress.py). `dev` puts a host array where the ops read it, `back` brings one back.

A step's sequences: a chunk from position 0 closing windows 0..2 (window 0 of CSA: no previous window); a chunk
whose first two tokens are replayed (slot -1: the window the second closes is stored already, nothing written),
the next window's predecessor half in the ring, half in the step; a chunk starting inside a window (its own
window half in the ring); a decode row closing a window (all but its own inputs in the ring) and one closing
none; each sequence in its own state slot of a ring whose other rows hold noise. Checks: every value of the pool
outside the closing rows' entry columns unchanged, and the ring; the entries within float32 reordering of
numpy's before their bf16 rounding (2^-8 relative plus 1e-6: one bf16 step at most), at least 97% of them the
same bf16 (a float32 sum in another order lands across a rounding edge now and then; measured in the emulation:
100% at every width). Told the windows do not overlap, reading another sequence's ring or reading the ring for
the step's own positions, the entries fail it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from engine.executor.cpu_dsv4_attention import compress_windows, entry_columns

# (name, head_dim, rope_dim, rate, overlap, index_dim or 0): the tiny models' CSA (with the indexer) and HCA;
# V4-Flash's CSA (entries of 512, the indexer's keys of 128) and HCA (entries of 128 tokens)
CASES = [("tiny_csa", 32, 8, 4, True, 16), ("tiny_hca", 32, 8, 8, False, 0),
         ("v4_flash_csa", 512, 64, 4, True, 128), ("v4_flash_hca", 512, 64, 128, False, 0)]
STATE_SLOTS = 7


@dataclass
class CompressInputs:
    spec: SimpleNamespace
    pool: np.ndarray            # bf16 bits [1, 1, 1 + kv slots, 1, row_width]: slot 0 a guard (the ops see the rest)
    ring: np.ndarray            # bf16 bits [1, state slots, ring_len, ring_width]
    weights: dict               # bf16 bits: layers.0.{comp_,idx_comp_}{ape,norm}
    truth: list                 # per sequence: float32 [positions, ring_width], its inputs by position
    start: np.ndarray           # int [G]: each sequence's first position in the step
    ring_slots: np.ndarray      # int [G]: its state slot
    pos: np.ndarray             # int [G, Q]: its step positions, -1 padding
    slots: np.ndarray           # int [G, Q]: their KV slots in the pool, -1 padding and replayed

    @property
    def kv_slots(self) -> np.ndarray:
        """The slots as the ops see them (the pool past its guard slot): a write at -1 lands on the guard."""
        return np.where(self.slots >= 0, self.slots - 1, -1)

    @property
    def first_row(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum((self.pos >= 0).sum(1))[:-1]])

    @property
    def inputs(self) -> np.ndarray:
        """The step's float32 inputs [T, ring_width], sequence after sequence."""
        return np.concatenate([t[s:] for t, s in zip(self.truth, self.start)]).astype(np.float32)


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f32(bits) -> np.ndarray:
    return np.asarray(bits).view(ml_dtypes.bfloat16).astype(np.float32)


def spec_of(head_dim: int, rope_dim: int, rate: int, overlap: bool, index_dim: int) -> SimpleNamespace:
    """A compressed layer's spec in the compact layout (DSV4AttentionSpec's fields the ops read)."""
    s = 2 if overlap else 1
    return SimpleNamespace(layer=0, head_dim=head_dim, series=s, rate=rate, overlap=overlap,
                           index_heads=4 if index_dim else 0, index_dim=index_dim or 16, rms_eps=1e-6,
                           compress_inv_freq=(160000.0 ** -(np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32),
                           ring="csa_ring" if overlap else "hca_ring", ring_index=0, ring_len=s * rate,
                           ring_width=2 * s * head_dim + (4 * index_dim if index_dim else 0),
                           row_width=2 * head_dim + (index_dim if index_dim else 0))


def random_inputs(head_dim: int, rope_dim: int, rate: int, overlap: bool, index_dim: int, seed: int):
    """The step of the module docstring: (first position, tokens, replayed tokens) per sequence."""
    rng = np.random.default_rng(seed)
    spec = spec_of(head_dim, rope_dim, rate, overlap, index_dim)
    steps = [(0, 3 * rate + 2, 0), (5 * rate - 2, rate + 3, 2), (7 * rate - 2, 3, 0), (9 * rate - 1, 1, 0),
             (7 * rate + 1, 1, 0)]
    G, Q, T = len(steps), max(n for _, n, _ in steps), sum(n for _, n, _ in steps)
    kv_slots = 1 + rng.permutation(T + 8)[:T]
    pool = bf16(rng.standard_normal((1, 1, T + 9, 1, spec.row_width)))
    ring = bf16(rng.standard_normal((1, STATE_SLOTS, spec.ring_len, spec.ring_width)))
    ring_slots = rng.permutation(STATE_SLOTS)[:G]
    pos, slots, truth, used = np.full((G, Q), -1), np.full((G, Q), -1), [], 0
    for g, (start, n, replayed) in enumerate(steps):
        truth.append(rng.standard_normal((start + n, spec.ring_width)).astype(np.float32))
        pos[g, :n] = start + np.arange(n)
        slots[g, replayed:n] = kv_slots[used + replayed:used + n]
        used += n
        for p in range(max(0, start - spec.ring_len), start):          # the ring: the last ring_len before start
            ring[0, ring_slots[g], p % spec.ring_len] = bf16(truth[g][p])
    weights = {}
    for name, d, on in (("comp_", head_dim, True), ("idx_comp_", index_dim, bool(index_dim))):
        if on:
            s = 2 if name == "idx_comp_" or overlap else 1
            weights[f"layers.0.{name}ape"] = bf16(rng.standard_normal((rate, s * d)))
            weights[f"layers.0.{name}norm"] = bf16(rng.uniform(0.5, 1.5, d))
    return CompressInputs(spec, pool, ring, weights, truth, np.array([s for s, _, _ in steps]), ring_slots, pos,
                          slots)


def device_state(ops, inp: CompressInputs, dev):
    """The pool (its guard slot included) and the ring on the device, the ops over the pool past the guard."""
    pool = dev(inp.pool.copy())
    ops.shared.kv_cache, ops.state = pool[:, :, 1:], {inp.spec.ring: dev(inp.ring.copy())}
    return pool


def run_compress(ops, inp: CompressInputs, dev, back, **override) -> tuple[np.ndarray, np.ndarray]:
    """The pool and the ring after compress_windows over every token row of the step (each with its sequence's
    first position in the step and state slot; its inputs its own row) on the device (override: the per-sequence
    start or ring_slots replaced, the tests' wrong readings)."""
    pool = device_state(ops, inp, dev)
    args = {"start": inp.start, "ring_slots": inp.ring_slots, **override}
    g, q = np.nonzero(inp.pos >= 0)                                 # sequence after sequence: the inputs' rows
    per_token = (inp.pos[g, q], inp.kv_slots[g, q], args["start"][g], args["ring_slots"][g])
    ops.compress_windows(*(dev(a.astype(np.int32)) for a in per_token), dev(inp.inputs),
                         {n: dev(a) for n, a in inp.weights.items()}, inp.spec)
    return back(pool), back(ops.state[inp.spec.ring])


def decode_step(inp: CompressInputs, dev) -> dict:
    """A decode step's device arrays: the one-token sequences, then the replayed closing token as a row with slot
    -1 whose ring does not hold its window (nothing may be written); stored: the one-token sequences' inputs."""
    one = np.flatnonzero((inp.pos >= 0).sum(1) == 1)
    g, q = np.nonzero((inp.pos >= 0) & ((inp.pos + 1) % inp.spec.rate == 0) & (inp.slots < 0))
    rows = np.concatenate([inp.first_row[one], inp.first_row[g] + q])
    return {"positions": dev(np.concatenate([inp.pos[one, 0], inp.pos[g, q]]).astype(np.int32)),
            "slots": dev(np.concatenate([inp.kv_slots[one, 0], inp.kv_slots[g, q]]).astype(np.int32)),
            "ring_slots": dev(np.concatenate([inp.ring_slots[one], inp.ring_slots[g]]).astype(np.int32)),
            "inputs": dev(inp.inputs[rows]), "weights": {n: dev(a) for n, a in inp.weights.items()},
            "stored": len(one)}


def launch_decode(ops, inp: CompressInputs, step: dict) -> None:
    """compress_windows as device_attention launches it (each token's first position its own, its row its own),
    then store_ring."""
    positions, ring_slots, inputs, n = step["positions"], step["ring_slots"], step["inputs"], step["stored"]
    ops.compress_windows(positions, step["slots"], positions, ring_slots, inputs, step["weights"], inp.spec)
    ops.store_ring(inp.spec, ring_slots[:n], positions[:n], inputs[:n])


def run_decode(ops, inp: CompressInputs, dev, back) -> tuple[np.ndarray, np.ndarray]:
    """The pool and the ring after launch_decode over decode_step's arrays."""
    step = decode_step(inp, dev)
    pool = device_state(ops, inp, dev)
    launch_decode(ops, inp, step)
    return back(pool), back(ops.state[inp.spec.ring])


def reference(inp: CompressInputs, only=None) -> np.ndarray:
    """The pool's float32 values with the closing windows' entries (and keys) of the sequences `only` (default
    every one) computed by compress_windows from their inputs (before start: as the ring holds them)."""
    spec, pool, m = inp.spec, f32(inp.pool), inp.spec.rate
    closing = (inp.pos >= 0) & ((inp.pos + 1) % m == 0) & (inp.slots >= 0)
    if only is not None:
        closing[np.setdiff1d(np.arange(len(closing)), only)] = False
    g, q = np.nonzero(closing)
    first = inp.pos[g, q] + 1 - m

    def window(at):                                               # [N, m, ring_width]: the inputs at positions at
        out = np.zeros((*at.shape, spec.ring_width), np.float32)
        for i, j in np.ndindex(*at.shape):
            p, seq = at[i, j], g[i]
            if p >= 0:
                v = inp.truth[seq][p]
                out[i, j] = v if p >= inp.start[seq] else f32(bf16(v))
        return out

    at = first[:, None] + np.arange(m)[None, :]
    rows, prev = window(at), window(np.where(at >= m, at - m, -1))
    w = {n: f32(a) for n, a in inp.weights.items()}
    cols, o = entry_columns(spec), 2 * spec.series * spec.head_dim
    series = [("comp_", slice(0, o), spec.overlap, cols[0])]
    if spec.index_heads:
        series.append(("idx_comp_", slice(o, None), True, cols[1]))
    for name, part, overlap, col in series:
        entries = compress_windows(rows[..., part], prev[..., part], first > 0, first, w[f"layers.0.{name}ape"],
                                   w[f"layers.0.{name}norm"], m, overlap, spec.compress_inv_freq, spec.rms_eps)
        pool[0, 0, inp.slots[g, q], 0, col:col + entries.shape[1]] = entries
    return pool


def check(got: tuple[np.ndarray, np.ndarray], want: np.ndarray, inp: CompressInputs, only=None) -> None:
    spec, (pool, ring) = inp.spec, got
    closing = (inp.pos >= 0) & ((inp.pos + 1) % spec.rate == 0) & (inp.slots >= 0)
    if only is not None:
        closing[np.setdiff1d(np.arange(len(closing)), only)] = False
    assert closing.sum() >= (4 if only is None else 1)
    touched = np.zeros(pool.shape, bool)
    cols = entry_columns(spec)
    for col, d in [(cols[0], spec.head_dim)] + ([(cols[1], spec.index_dim)] if spec.index_heads else []):
        touched[0, 0, inp.slots[closing], 0, col:col + d] = True
    np.testing.assert_array_equal(pool[~touched], inp.pool[~touched], err_msg="values outside the entries")
    g, w = f32(pool[touched]), want[touched]
    np.testing.assert_allclose(g, w, rtol=2 ** -8, atol=1e-6, err_msg="entries")
    assert np.mean(g == f32(bf16(w))) >= 0.97, np.mean(g == f32(bf16(w)))
    if only is None:
        np.testing.assert_array_equal(ring, inp.ring, err_msg="the ring")


def check_a_replayed_close_writes_nothing(inp: CompressInputs) -> None:
    """The case holds a closing token whose slot is -1 (a replayed position)."""
    assert ((inp.pos >= 0) & ((inp.pos + 1) % inp.spec.rate == 0) & (inp.slots < 0)).any()


def check_decode_ring(ring: np.ndarray, inp: CompressInputs) -> None:
    """After run_decode: each one-token sequence's inputs at its row of its ring (bf16), every other row as it was."""
    want = inp.ring.copy()
    for g in np.flatnonzero((inp.pos >= 0).sum(1) == 1):
        p = inp.pos[g, 0]
        want[0, inp.ring_slots[g], p % inp.spec.ring_len] = bf16(inp.truth[g][p])
    np.testing.assert_array_equal(ring, want)


def run_ring_store(ops, inp: CompressInputs, dev, back) -> tuple[np.ndarray, np.ndarray]:
    """step_rows over the step as a mixed step's device arrays (its token rows sequence after sequence), then
    store_ring of the rows it keeps: (the ring, each row's first position in the step by step_rows)."""
    from engine.executor.gpu_dsv4_ops import step_rows

    ops.state = {inp.spec.ring: dev(inp.ring.copy())}
    n, (g, q) = (inp.pos >= 0).sum(1), np.nonzero(inp.pos >= 0)
    ctx = SimpleNamespace(batch=object(), decode_only=False, dsv4=None,
                          positions=dev(inp.pos[g, q].astype(np.int32)),
                          token_seq=dev(g.astype(np.int32)), state_slots=dev(inp.ring_slots.astype(np.int32)),
                          cu_seqlens=dev(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)),
                          block_tables=dev(np.zeros((len(n), 1), np.int32)))
    _, ring_slots, starts, kept = step_rows(ctx, inp.spec, ops.cp)
    ops.store_ring(inp.spec, ring_slots, kept, dev(inp.inputs))
    return back(ops.state[inp.spec.ring]), back(starts)


def check_ring_store(got, inp: CompressInputs) -> None:
    """The ring holds each sequence's last ring_len positions (bf16), the other slots' rows as they were; every
    row's first position is its sequence's start."""
    ring, starts = got
    want = inp.ring.copy()
    for g, (t, s) in enumerate(zip(inp.truth, inp.start)):
        for p in range(max(s, len(t) - inp.spec.ring_len), len(t)):
            want[0, inp.ring_slots[g], p % inp.spec.ring_len] = bf16(t[p])
    np.testing.assert_array_equal(ring, want, err_msg="the ring")
    np.testing.assert_array_equal(starts, np.repeat(inp.start, (inp.pos >= 0).sum(1)))
