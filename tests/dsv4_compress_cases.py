"""DeepSeek-V4's compressor closing its windows on the device (dsv4_compress.cu through GpuDSV4Ops.close_entries)
against the numpy one (cpu_dsv4_attention.close_entries, held to transformers' by the gate), on random paged
pools: shared by the host emulation (tests/kernels/test_dsv4_compress_emulated.py) and the device test
(tests/gpu/test_gpu_dsv4_compress.py). `dev` puts a host array where the ops read it, `back` brings one back.

A step's tokens: decode rows that close a window and rows that do not, a chunk closing several windows (window 0
of CSA among them: no previous window), padding. Checks: every value of the pool outside the closing rows' entry
columns unchanged; the entries within float32 reordering of numpy's before their bf16 rounding (2^-8 relative
plus 1e-6: one bf16 step at most), at least 97% of them the same bf16 (a float32 sum in another order lands
across a rounding edge now and then; measured in the emulation: 100% at every width). Told the windows do not
overlap, CSA's entries fail it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from engine.executor.cpu_dsv4_attention import NumpyDSV4Ops, entry_columns
from memory.kv_pool import BLOCK_SIZE

# (name, head_dim, rope_dim, rate, overlap, index_dim or 0): the tiny models' CSA (with the indexer) and HCA;
# V4-Flash's CSA (entries of 512, the indexer's keys of 128) and HCA (entries of 128 tokens)
CASES = [("tiny_csa", 32, 8, 4, True, 16), ("tiny_hca", 32, 8, 8, False, 0),
         ("v4_flash_csa", 512, 64, 4, True, 128), ("v4_flash_hca", 512, 64, 128, False, 0)]


@dataclass
class CompressInputs:
    spec: SimpleNamespace
    pool: np.ndarray            # bf16 bits [1, 1, slots, 1, row_width]
    weights: dict               # bf16 bits: layers.0.{comp_,idx_comp_}{ape,norm}
    tables: np.ndarray          # int [G, blocks]
    pos: np.ndarray             # int [G, Q], -1 padding


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f32(bits) -> np.ndarray:
    return np.asarray(bits).view(ml_dtypes.bfloat16).astype(np.float32)


def random_inputs(head_dim: int, rope_dim: int, rate: int, overlap: bool, index_dim: int, seed: int):
    """Four sequences: a chunk of 3·rate + 2 tokens from position 0 (closing windows 0..2), decode rows that close
    windows 5 and 8 and one that closes none, and padding."""
    rng = np.random.default_rng(seed)
    spec = SimpleNamespace(layer=0, head_dim=head_dim, series=2 if overlap else 1, rate=rate, overlap=overlap,
                           index_heads=4 if index_dim else 0, index_dim=index_dim or 16, rms_eps=1e-6,
                           compress_inv_freq=(160000.0 ** -(np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32))
    Q, ends = 3 * rate + 2, np.array([3 * rate + 1, 6 * rate - 1, 9 * rate - 1, 7 * rate + 1])
    per_seq = -(-int(ends.max() + 1) // BLOCK_SIZE)
    blocks = rng.permutation(4 * per_seq + 2)
    tables = blocks[:4 * per_seq].reshape(4, per_seq)
    width = head_dim + 2 * spec.series * head_dim + (4 * index_dim if index_dim else 0)
    pool = bf16(rng.standard_normal((1, 1, len(blocks) * BLOCK_SIZE, 1, width)))
    pos = np.full((4, Q), -1)
    pos[0] = np.arange(Q)
    pos[1:, 0] = ends[1:]
    weights = {}
    for name, d, on in (("comp_", head_dim, True), ("idx_comp_", index_dim, bool(index_dim))):
        if on:
            s = 2 if name == "idx_comp_" or overlap else 1
            weights[f"layers.0.{name}ape"] = bf16(rng.standard_normal((rate, s * d)))
            weights[f"layers.0.{name}norm"] = bf16(rng.uniform(0.5, 1.5, d))
    return CompressInputs(spec, pool, weights, tables, pos)


def run_compress(ops, inp: CompressInputs, dev, back) -> np.ndarray:
    """The pool after close_entries on the device."""
    ops.shared.kv_cache = dev(inp.pool.copy())
    ops.close_entries(inp.tables, None, inp.pos, {n: dev(a) for n, a in inp.weights.items()}, inp.spec)
    return back(ops.shared.kv_cache)


def reference(inp: CompressInputs) -> np.ndarray:
    """The pool's float32 values after the numpy close_entries."""
    pool = f32(inp.pool)
    slots = np.where(inp.pos >= 0, _slots(inp.tables, inp.pos), -1)
    NumpyDSV4Ops(pool).close_entries(inp.tables, slots, inp.pos, {n: f32(a) for n, a in inp.weights.items()},
                                     inp.spec)
    return pool


def _slots(tables, pos):
    p = np.maximum(pos, 0)
    return np.take_along_axis(tables, p // BLOCK_SIZE, 1) * BLOCK_SIZE + p % BLOCK_SIZE


def check(got: np.ndarray, want: np.ndarray, inp: CompressInputs) -> None:
    spec = inp.spec
    closing = (inp.pos >= 0) & ((inp.pos + 1) % spec.rate == 0)
    assert closing.sum() >= 4
    slots = _slots(inp.tables, inp.pos)[closing]
    touched = np.zeros(got.shape, bool)
    cols = entry_columns(spec)
    spans = [(cols[0], spec.head_dim)] + ([(cols[1], spec.index_dim)] if spec.index_heads else [])
    for col, d in spans:
        touched[0, 0, slots, 0, col:col + d] = True
    np.testing.assert_array_equal(got[~touched], inp.pool[~touched], err_msg="values outside the entries")
    g, w = f32(got[touched]), want[touched]
    np.testing.assert_allclose(g, w, rtol=2 ** -8, atol=1e-6, err_msg="entries")
    assert np.mean(g == f32(bf16(w))) >= 0.97, np.mean(g == f32(bf16(w)))
