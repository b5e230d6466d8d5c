"""The one layout the W4A16 kernel reads (raw_cuda/gemv_w4.cu), re-packed once at load from ``W4Codes``.

For each 16-row tile and 128-wide k step, a warp loads 1 KB of codes as two 512-byte pieces (rows g and
g + 8 of the tile), each lane 16 bytes: 32 consecutive k of one row in four words. Within a word, the
code of k offset j (0..7) sits in nibble ``NIBBLE_OF[j]`` (pairs (j, j + 1) in nibbles p and p + 4), so a
mask and an OR turn a pair into bf16 operands of the tensor-core product. Scales (and zeros) of a tile
are ordered [group][g][half]: a lane's two rows of one group in one load. N is padded to whole tiles, K
to whole steps and the groups to cover them, with zero codes and zero scales (weights 0).

``pack_w4`` takes any leading (expert) dims: the experts' layouts one after another, as the grouped
entry reads them. ``unpack_w4`` inverts it (the tests' proof that nothing is lost), ``kernel_defines``
names the compile-time format of the kernel for a ``W4Codes``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .w4_formats import FP16, W4Codes

TILE_N, STEP_K = 16, 128
NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)      # k offset j of a word's 8 -> its nibble (AWQ's packing order)


@dataclass(frozen=True)
class W4Packed:
    """A weight in the kernel's layout; ``n``, ``k``: the logical shape (the arrays are padded)."""

    codes: np.ndarray          # uint32 [..., N/16, K/128, 2, 32, 4]
    scales: np.ndarray         # uint16 [..., N/16, G, 8, 2]
    zeros: np.ndarray | None   # uint8 [..., N/16, G, 8, 2]
    n: int
    k: int
    group: int
    scale_dtype: str
    fp4: bool

    @property
    def defines(self) -> dict[str, int]:
        """gemv_w4.cu's compile-time format."""
        return {"W4_FP4": int(self.fp4), "W4_ZERO": int(self.zeros is not None),
                "W4_SCALE_FP16": int(self.scale_dtype == FP16)}

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.zeros is None else self.zeros.nbytes)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _pad(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    pad = [(0, 0)] * (a.ndim - 2) + [(0, rows - a.shape[-2]), (0, cols - a.shape[-1])]
    return np.pad(a, pad)


def _group_order(a: np.ndarray, tiles: int) -> np.ndarray:
    """[..., N_pad, G] per-group values -> [..., tiles, G, 8 (g), 2 (half)]: row 16·tile + 8·half + g."""
    lead = a.shape[:-2]
    t = a.reshape(*lead, tiles, 2, 8, a.shape[-1])
    return np.ascontiguousarray(np.moveaxis(t, (-4, -3, -2, -1), (-4, -1, -2, -3)))


def pack_w4(w: W4Codes) -> W4Packed:
    """Re-pack 4-bit codes (+ scales, zeros) into the kernel layout."""
    *lead, n, k = w.codes.shape
    tiles, steps = _ceil(n, TILE_N), _ceil(k, STEP_K)
    groups = _ceil(steps * STEP_K, w.group)
    codes = _pad(w.codes, tiles * TILE_N, steps * STEP_K).astype(np.uint32)
    # row = 16·tile + 8·half + g; k = 128·step + 32·t + 8·word + j
    c = codes.reshape(*lead, tiles, 2, 8, steps, 4, 4, 8)
    nd = len(lead)
    c = c.transpose(*range(nd), nd, nd + 3, nd + 1, nd + 2, nd + 4, nd + 5, nd + 6)   # tile, step, half, g, t, word, j
    words = np.zeros(c.shape[:-1], np.uint32)
    for j, nib in enumerate(NIBBLE_OF):
        words |= c[..., j] << np.uint32(4 * nib)
    words = words.reshape(*lead, tiles, steps, 2, 32, 4)
    scales = _group_order(_pad(w.scales, tiles * TILE_N, groups), tiles)
    zeros = None if w.zeros is None else _group_order(_pad(w.zeros, tiles * TILE_N, groups), tiles)
    return W4Packed(words, scales, zeros, n, k, w.group, w.scale_dtype, w.fp4)


def _ungroup(a: np.ndarray, n: int, k: int, group: int) -> np.ndarray:
    """Inverse of _group_order, cut to the logical [..., N, K / group]."""
    t = np.moveaxis(a, (-4, -1, -2, -3), (-4, -3, -2, -1))
    return t.reshape(*a.shape[:-4], -1, a.shape[-3])[..., :n, :k // group]


def unpack_w4(p: W4Packed) -> W4Codes:
    """The W4Codes a W4Packed was made from."""
    *lead, tiles, steps = p.codes.shape[:-3]
    nd = len(lead)
    nib = (p.codes[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF          # [..., word, nibble]
    c = nib[..., list(NIBBLE_OF)].reshape(*lead, tiles, steps, 2, 8, 4, 4, 8)         # tile, step, half, g, t, word, j
    c = c.transpose(*range(nd), nd, nd + 2, nd + 3, nd + 1, nd + 4, nd + 5, nd + 6)   # tile, half, g, step, t, word, j
    codes = c.reshape(*lead, tiles * TILE_N, steps * STEP_K)[..., :p.n, :p.k].astype(np.uint8)
    zeros = None if p.zeros is None else _ungroup(p.zeros, p.n, p.k, p.group)
    return W4Codes(np.ascontiguousarray(codes), np.ascontiguousarray(_ungroup(p.scales, p.n, p.k, p.group)),
                   p.scale_dtype, None if zeros is None else np.ascontiguousarray(zeros), p.group, p.fp4)
