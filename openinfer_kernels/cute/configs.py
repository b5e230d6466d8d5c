"""The compiled kernel variants and the table that picks one for a GEMM shape (no DSL import).

``plan_gemm`` was tuned from the H200 sweeps of 2026-11-30 and 2026-12-01 (see the note above it) and
re-timed as a plan on 2026-12-01 (bench/results/kernels.md).

Shared by the build (what to compile) and the launcher (what to call). A variant's ``name`` is its
symbol prefix in the shared library and its key in the manifest.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

H200_SMS = 132


@dataclass(frozen=True)
class GemmVariant:
    """A bf16 GEMM tile config; ``out='f32'`` variants write split-K partials."""

    tile_m: int
    tile_n: int
    cluster_m: int = 1
    cluster_n: int = 1
    out: str = "bf16"
    grouped: bool = False  # MoE: B is (N, K, experts), one expert per M-tile
    residual: bool = False  # D = A·Bᵀ + R, R added in fp32 in the epilogue (R may be D itself)
    k_split: int = 1  # 2: a cluster of two CTAs splits K; the second sends its sums over DSMEM
    ws: bool = False  # warp-specialised: a producer warpgroup issues the TMA loads, the others only compute
    silu: bool = False  # D[:, j] = SiLU(P[:, gate j])·P[:, up j] of the product P, B's rows interleaved (gate_up)
    a_rows: int = 0  # > 0: the TMA loads only A's first a_rows rows of the tile (for M <= a_rows)
    fp8: bool = False  # A and B e4m3 with per-128 block scales (gemm_sm90_fp8), D bf16

    @property
    def name(self) -> str:
        kind = "grouped" if self.grouped else "gemm"
        suffix = (("_k2" if self.k_split == 2 else "") + ("_ws" if self.ws else "") + ("_res" if self.residual else "")
                  + ("_silu" if self.silu else "") + (f"_a{self.a_rows}" if self.a_rows else ""))
        inputs = "fp8" if self.fp8 else self.out
        return f"{kind}_{inputs}_{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}{suffix}"


GEMM_VARIANTS: tuple[GemmVariant, ...] = (
    GemmVariant(128, 256, 1, 1),
    GemmVariant(128, 256, 2, 1),
    GemmVariant(128, 128, 1, 1),
    GemmVariant(128, 128, 2, 1),
    GemmVariant(128, 192, 1, 1),    # a wave-quantisation width (N 6144 at M = 512: 128 tiles, one wave)
    GemmVariant(128, 192, 2, 1),
    GemmVariant(128, 160, 1, 2),    # N = 2560 at M = 1000-2048: 2 waves; A multicast to an N-pair
    GemmVariant(128, 80, 1, 2),     # N = 2560 at M = 512 in 128 tiles (cuBLAS's choice), two warpgroups
    GemmVariant(128, 80, 1, 1),
    GemmVariant(128, 320, 1, 1),    # cuBLAS's tile for N = 2560 at M = 2048 (8 x 16: one wave)
    GemmVariant(128, 320, 2, 1),
    GemmVariant(128, 160, k_split=2),   # N = 2560 at M = 512: 4 x 16 tiles x 2 K-halves, one wave
    GemmVariant(128, 256, k_split=2),
    GemmVariant(128, 128, k_split=2),
    GemmVariant(128, 192, k_split=2),
    GemmVariant(64, 128, 1, 1),
    GemmVariant(64, 256, 1, 1),
    GemmVariant(192, 64, 1, 1),     # N = 6144 in 96 tiles: qkv at M = 129-192
    GemmVariant(192, 128, 1, 1),    # M = 129-192 (and 384) in whole 192-row tiles: three warpgroups
    GemmVariant(192, 160, 1, 1),
    GemmVariant(192, 192, 1, 1),
    GemmVariant(192, 256, 1, 1),
    GemmVariant(192, 64, 1, 1, "f32"),
    GemmVariant(192, 128, 1, 1, "f32"),
    GemmVariant(64, 64, 1, 1, "f32"),
    GemmVariant(64, 128, 1, 1, "f32"),
    GemmVariant(64, 256, 1, 1, "f32"),
    # Stream widths (M <= 64) that cut a projection into ~128 CTAs, one per SM, where 64x128 / 64x256
    # leave SMs idle: qkv 6144 / 48, 4B.gate_up 19456 / 160 (122), 8B.gate_up 24576 / 192; split in
    # K: 2560 / 80 x 4 (4B o / down), 96 for the widths between
    GemmVariant(64, 48),
    GemmVariant(64, 160),
    GemmVariant(64, 192),
    GemmVariant(64, 80, 1, 1, "f32"),
    GemmVariant(64, 96, 1, 1, "f32"),
    # K pairs of 64-row stream tiles, the DSMEM exchange (12-16 KB) in place of the split-K
    # reduction kernel: 4096 / 64 x 2 = 128 CTAs (8B o / down), 2560 / 48 x 2 = 108 (4B o / down;
    # 40 wide would give 128, but a width that 16 does not divide (40, 56) aborts the DSL in the
    # B operand's TMA atom). 8B o / down at M = 32-64: 11.3 / 26.7 µs against 11.9 / 27.0 in 4
    # splits of 128 (H200, 2026-12-01 19:29 UTC); 4B o / down (108 CTAs) lose to 80 x 4 splits.
    GemmVariant(64, 48, k_split=2),
    GemmVariant(64, 64, k_split=2),
    # M = 65-128 in one row of 128-row tiles, about one CTA per SM (`_one_row_plan`): qkv 6144 / 48
    # = 128 tiles, 4B o / down 2560 / 80 x 4 splits, 8B o / down 4096 / 64 x 2 (K pairs).
    GemmVariant(128, 48),
    GemmVariant(128, 80, 1, 1, "f32"),
    GemmVariant(128, 64, k_split=2),
    GemmVariant(128, 48, k_split=2),
    # M = 193-256 in two rows of 128-row tiles, one CTA per SM (`_tile_plan`): qkv 6144 / 96 x 2
    # rows = 128 tiles, 4B o 2560 / 80 x 2 rows x 2 (K pairs) = 128.
    GemmVariant(128, 96),
    GemmVariant(128, 80, k_split=2),
    GemmVariant(64, 128, 1, 1, grouped=True),
    GemmVariant(128, 128, 1, 1, grouped=True),
)


def takes_producer_warpgroup(v: GemmVariant) -> bool:
    """The tiles the plan runs warp-specialised: bf16 64- and 128-row tiles but K pairs. With a
    producer warpgroup, TMA multicast no longer stalls the MMA warps (4B.down M = 512 on 128x80 1x2:
    49.1 -> 41.1 µs, 8B.down on 128x128 2x1: 72.9 -> 70.0, 4B.gate_up on 128x160 1x2: 83.0 -> 80.5);
    elsewhere the same within 1-3% (H200, 2026-12-01 17:50 UTC). Split-K (f32) tiles, K pairs and
    192-row tiles (512 threads would cap registers at 128) keep warp 0 as the producer."""
    return (v.out == "bf16" and not v.grouped and v.k_split == 1 and v.tile_m in (64, 128) and v.tile_n <= 256
            and not v.residual)


def takes_weight_prefetch(v: GemmVariant, m: int) -> bool:
    """Whether a launch uses ``prefetch_weights`` (its weights' ring fill before the programmatic
    launch wait): the weight streams, 64-row tiles and one row of 128-row tiles (M <= 128). A decode
    layer's four projections ran 4-8% faster at M <= 64 and 1-3% at M = 96-128 (8B 113.8 -> 110.3
    µs at M = 96; H200, 2026-12-01 19:40 UTC); on 128-row tiles at larger M and on 192-row tiles it
    was up to 12% slower (8B.qkv at M = 8192, 8B.down at 2048)."""
    return v.tile_m == 64 or (v.tile_m == 128 and m <= 128)


GEMM_VARIANTS += tuple(replace(v, ws=True) for v in GEMM_VARIANTS if takes_producer_warpgroup(v))
# Every dense bf16 variant has a residual twin, so that any plan can fuse the add (split-K plans
# add it in the reduction instead).
# (Not 128x256 K-pairs: with R's tile in shared memory, their B ring cannot hold the peer's sums;
# not 128x320: R's 80 KB would leave two ring stages.)
GEMM_VARIANTS += tuple(replace(v, residual=True) for v in GEMM_VARIANTS
                       if v.out == "bf16" and not v.grouped and not (v.k_split == 2 and v.tile_n == 256)
                       and v.tile_n <= 256)


def takes_silu_epilogue(v: GemmVariant) -> bool:
    """The tiles with a SiLU·up twin: those the plan runs warp-specialised, whose half-width output
    tile is a whole number of 16-wide epilogue tiles (not 48 or 80: 24 / 40 columns)."""
    return v.ws and not v.residual and v.tile_n % 32 == 0


# SiLU·up twins (gate_up at M <= 128, where decode runs the CuTe GEMM): one kernel fewer per MLP
GEMM_VARIANTS += tuple(replace(v, silu=True) for v in GEMM_VARIANTS if takes_silu_epilogue(v))
A_BOX_ROWS = 16  # M <= this: the 64-row tiles the plan takes there load only A's first 16 rows


def takes_a_box(v: GemmVariant) -> bool:
    """The tiles with an ``a_rows`` twin: the 64-row tiles the plan runs at M <= A_BOX_ROWS (weight
    streams, warp-specialised or split in K; not K pairs, which start at M = 17)."""
    return v.tile_m == 64 and v.k_split == 1 and not v.grouped and (v.ws or v.out == "f32")


GEMM_VARIANTS += tuple(replace(v, a_rows=A_BOX_ROWS) for v in GEMM_VARIANTS if takes_a_box(v))
REDUCE_NAME = "splitk_reduce"
REDUCE_RESIDUAL_NAME = "splitk_reduce_res"
VARIANTS_BY_NAME = {v.name: v for v in GEMM_VARIANTS}
# FP8 block-scaled twins (gemm_sm90_fp8): warp-specialised, a consumer warpgroup per 64 rows, a tile's columns
# in one 128-wide B scale block (wider tiles do not fit the promotion's registers: gemm_sm90_fp8). Not tuned on a
# GPU yet: plan_fp8_gemm is a wave-fill rule to be replaced by the sweep of bench/quant_kernels.py. The 2x1
# cluster multicasts the weight tile to an M-pair: 24 KB of L2 reads a CTA and 128-wide k-tile instead of 32, as
# at twice the bf16 MMA rate a 128x128 tile's operands (128 flop a byte) would ask ~15 TB/s of L2 at peak.
FP8_GEMM_VARIANTS: tuple[GemmVariant, ...] = (
    GemmVariant(128, 128, ws=True, fp8=True),
    GemmVariant(128, 128, 2, 1, ws=True, fp8=True),
    GemmVariant(128, 64, ws=True, fp8=True),
    GemmVariant(64, 128, ws=True, fp8=True),
)
FP8_VARIANTS_BY_NAME = {v.name: v for v in FP8_GEMM_VARIANTS}


def silu_twin(plan: GemmPlan) -> GemmVariant | None:
    """The SiLU·up twin of an unsplit plan's variant, None where it has none (split in K, or a tile
    without a twin): the caller then runs the plain product and the activation apart."""
    if plan.splits != 1:
        return None
    return VARIANTS_BY_NAME.get(replace(plan.variant, silu=True).name)


@dataclass(frozen=True)
class GemmPlan:
    """What the launcher runs for one shape: a variant and the number of K splits (1 = none)."""

    variant: GemmVariant
    splits: int = 1


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


K_TILE = 64  # k-extent of one pipeline stage
MIN_K_TILES_PER_SPLIT = 2
MAX_SPLITS = 16


def split_count(k: int, splits: int) -> int:
    """Splits actually launched for a requested count: each gets ceil(k_tiles / S) k-tiles and
    none may be empty, so e.g. 5 k-tiles asked in 4 splits run as 3 splits of 2, 2, 1."""
    k_tiles = _ceil(k, K_TILE)
    return _ceil(k_tiles, _ceil(k_tiles, max(1, min(splits, k_tiles))))


def wave_fill(ctas: int, sms: int = H200_SMS) -> float:
    """Busy fraction of the SM-slots over the waves ``ctas`` CTAs take (one CTA per SM at a time)."""
    return ctas / (_ceil(ctas, sms) * sms)


def wave_splits(tiles: int, k: int, sms: int = H200_SMS) -> int:
    """Most K splits that keep ``tiles·S`` CTAs within one wave: at most MAX_SPLITS, each split
    at least MIN_K_TILES_PER_SPLIT k-tiles, none empty (1 when the tiles alone fill a wave)."""
    s = max(1, min(MAX_SPLITS, sms // tiles, _ceil(k, K_TILE) // MIN_K_TILES_PER_SPLIT))
    while s > 1 and split_count(k, s) != s:
        s -= 1
    return s


# The plan table was tuned from the 2026-11-30 H200 sweep (bench/kernels.py times every verified
# variant and split count on the Qwen3-4B/8B projections, M = 1 … 8192; bench/results/kernels.md):
# - M <= 128 streams the weights: 64-row tiles, K split so the CTAs fill one wave; the wider 64x256
#   tile where it fills clearly better (qkv: 24 tiles x 5 splits), else 64x128 with fewer splits
#   (o/down: 20 x 6; 8B: 32 x 4), no split once the 64x256 tiles fill the SMs (gate_up). At M = 128
#   this was up to 1.9x faster than the former 128x128 choice.
# - Beyond that, 128x256 or 128x128 by wave quantisation (narrow N at M = 512: 128x128 was up to
#   1.9x faster than 128x256), the 2x1 cluster only with two 128-row tiles to pair.
# - 128x192 (added 2026-12-01): one wave where 128 needs two and 256 leaves SMs idle (N = 6144 at
#   M = 512: 4B.qkv 28.2 -> 24.4 µs, 8B.qkv 47.8 -> 35.9 µs) and at 4B.o M = 2048 (72.7 -> 66.5 µs).
#   128x80 (N = 2560 in 32 tiles: one wave at M = 512) is correct with 16-wide epilogue tiles but runs
#   at ~0.6 of 256's rate per element: 7% faster than 128x128 at 4B.o M = 512, far slower beyond; not built.
# - 128x160 with a 1x2 cluster (added 2026-12-01, 04:40-04:48 UTC sweeps): N = 2560 in 16 tiles, so M = 1000 /
#   2048 fill 1 / 2 whole waves; per element it runs at 128x128's rate (0.88 of 256). 4B.o 2048
#   66.5 -> 61.5-62.3 µs, 4B.down 1000 / 2048 74 -> 69-71 / 162 -> 138-143 µs, 4B.gate_up 512
#   83 -> 80 µs. Tried and not kept (each verified, none faster; bench/results/kernels.md): stream-K,
#   128x80 with A multicast (1x2, 2x2), two wgmma batches in flight, two consumer warpgroups on
#   128x128, A loaded into wgmma registers straight from global memory.
# - 2026-12-01, 05:37-06:19 UTC: K-split cluster pairs (`_k2`) from M = 256 at K >= 4096 (N = 2560 / 4096
#   at M = 256-512: 1.1-1.9x); 128x160 / 192 allowed from M = 256; no 2x1 cluster over an odd number
#   (< 8) of M-tiles (it padded a row of empty tiles: 4B.qkv M = 640 55.0 -> 28.8 µs).
# - 2026-12-01, 07:02-07:29 UTC: 128 < M <= 192 takes one row of 192-row tiles (three warpgroups; the
#   plan had two rows of 128, up to half empty: 1.1-2.1x at M = 160-192), and from M = 129 the K pairs
#   and 160 / 192 widths compete (1.2-1.5x at M = 224). The launcher reads A to whole tiles
#   (gemm.readable_rows), which made K pairs on a partial tile up to 1.45x faster. Re-swept so
#   (07:36): 192x64 split beats 192x128 split twice as often; qkv keeps 128-row tiles; 48 and more
#   64-row tiles stream unsplit (qkv at M <= 64, 8B.o at 96-128: 1.1-1.3x); the wide 128-row tiles
#   from M = 65 (gate_up, 4-10%); 128x128 K pairs at M = 65-128 where they are 48 CTAs or more (8B
#   down 35.0 against 38.6 µs, qkv 19.8 against 21.6, o 15.1 against 15.6), else 192-row tiles split
#   in K where the stream would split (4B o / down, 4-6%): `_small_m_plan`.
# - 2026-12-01, 17:34-18:07 UTC: bf16 64/128-row tiles run warp-specialised (a producer warpgroup:
#   multicast tiles 3-16% faster); 128x80 on two warpgroups takes N = 2560 at M = 512 (one wave,
#   cuBLAS's tile; 4B.o 20.4 -> 19.7 µs); 128x320 takes N = 2560 at M = 2048 and 4B.gate_up
#   (one wave where 160 needs two: 4B.o 2048 60.5 -> 56.0, 4B.gate_up 512 82.5 -> 74.9); qkv at
#   M = 129-192 streams unsplit 192x64 tiles (1.1-1.2x).
# - 2026-12-01, 18:27-18:49 UTC: at M <= 64 the stream width (48 ... 256) and K split whose CTAs fill
#   one wave, one per SM (`_stream_plan`): with the weights prefetched, a decode layer's four
#   projections 63.9 -> 56.7 µs (4B, M = 1) and 107.2 -> 97.4 (8B).
# - 2026-12-01, 19:29-19:51 UTC: M = 65-128 in one row of 128-row tiles where one fills 90% of a
#   wave (`_small_m_plan`: 128x48, 128x80 split in K, 128x64 K pairs), weights prefetched there;
#   64-row K pairs from M = 17 (8B o / down). The decode layer's four projections at M = 96 / 128:
#   4B 76.5 / 79.6 -> 70.6 / 74.9 µs, 8B 132.2 / 133.4 -> 113.9 / 114.5; at M = 32 / 64 (8B)
#   105.4 / 108.2 -> 102.0 / 103.2. Two-wave alternatives at M = 160-256 (128x48, 128x64 K pairs,
#   128x80 split) were 1.1-1.6x slower than the plan and are not taken. M = 193-256 (two rows of
#   128-row tiles, one CTA per SM): 128x96 for qkv (TILE_EFFICIENCY[96]) and 80-wide K pairs at
#   K <= 4096 (4B o): 8B.qkv 25.2 -> 23.6 µs, 4B.qkv 16.4 -> 15.3, 4B.o 15.0 -> 14.2.
# The whole plan was re-timed on 2026-12-01, 19:57 UTC (589 / 589 verification cases passed, the
# planned path included): 22 of the 24 rows at M = 512 / 2048 / 8192 within 5% of cuBLAS.
STREAM_MAX_M = 128
FILL_TOLERANCE = 0.9        # single-wave fills within 10% count as equal: fewer splits win
UNSPLIT_MIN_CTAS = 48       # 64-row tiles: this many stream unsplit (qkv at M <= 64: 48 of 64x128,
                            # 11.0 / 16.2 µs against 12.5-14.6 / 18.7-20.7 in 5 splits of 64x256;
                            # 8B.o at M = 96-128: 15.6 against 18.2; swept 2026-12-01, 07:34-07:36)
UNSPLIT_MAX_K = 4096        # ... but not 8B.down (K = 12288) at M = 96-128: 43.0 against 38.6 in 4 splits
# 128-row tiles: relative throughput per element (sweeps of 2026-11-30 and, for 192 / 160, 2026-12-01)
TILE_EFFICIENCY = {320: 1.0, 256: 1.0, 192: 0.95, 160: 0.88, 128: 0.85, 96: 0.8, 80: 0.77}
# (96, set so that the measured wins take it: qkv at M = 256 in 128 tiles of 96, 4B 15.3 µs against
# 16.4 for 96 of 128, 8B 23.6 against 25.2 for 128x192 K pairs; 2026-12-01 19:58 UTC)
WIDE_192_MIN_M = 65         # 128x192 and 128x160: swept from M = 64 up (2026-12-01; gate_up at
                            # M = 96-128: 4B 128x160 c1x2 28.8-29.6 against 32.2-32.5 µs of 128x256)
K_PAIR_MIN_M = 129          # K-split pairs: measured (2026-12-01) to win at M = 193-512 on narrow N
ROW_192_MAX_M = 192         # 128 < M <= 192: one row of 192-row tiles (swept 2026-12-01, 07:15 UTC)
ROW_192_MIN_FILL = 0.7      # ... where one fills this much of a wave (qkv: 96 of 192x64, 0.73)
K_PAIR_MIN_K = 4096         # ... with K >= 4096; at K = 2560 (qkv, gate_up of the 4B) the exchange did not pay
K_PAIR_COST = 1.2           # a pair's half-K CTA relative to half a tile's work (DSMEM exchange, epilogue)
NARROW_96_MAX_M = 256       # 128x96 where it was timed: two rows of tiles (qkv at M = 256)
K_PAIR_80_MAX_K = 4096      # 80-wide K pairs (4B o at M = 256: 14.2 against 15.0 µs) only at short K: on
                            # 4B down (K = 9728) they lost, 29.6 against 28.0 (2026-12-01 19:58 UTC)


STREAM_WIDTHS = (256, 192, 160, 128, 48)   # bf16 64-row tiles streamed unsplit at M <= 64
STREAM_PAIR_WIDTHS = (64, 48)               # bf16 64-row K pairs at M <= 64
SPLIT_WIDTHS = (128, 96, 80, 256)           # f32 64-row tiles split in K at M <= 64, in order of preference
STREAM_FILL_TOLERANCE = 0.95                # one row of tiles: fills within 5% count as equal
STREAM_K_PAIR_MIN_M = 17                    # 64-row K pairs from this M (8B o / down at M = 8: 11.3 / 26.6 µs
                                            # against 11.2 / 26.3 split; at 32-64 they win, 2026-12-01 19:29)
ROW_128_WIDTHS = (256, 192, 160, 128, 80, 48)   # M = 65-128: one row of 128-row tiles, unsplit ...
ROW_128_PAIR_WIDTHS = (192, 160, 128, 64, 48)   # ... in K pairs (no 128x256 pair: no residual twin) ...
ROW_128_SPLIT_WIDTHS = (80,)                    # ... or split in K
ROW_128_MIN_FILL = 0.9      # ... where one of them fills this much of a wave


def _one_row_plan(tile_m: int, n: int, k: int, sms: int, unsplit: tuple[int, ...], pairs: tuple[int, ...],
                  splits: tuple[int, ...]) -> tuple[float, GemmPlan | None]:
    """One row of ``tile_m``-row tiles, about one CTA per SM: the fullest single wave over the
    ``unsplit`` bf16 widths, K pairs of the ``pairs`` widths (at K >= K_PAIR_MIN_K) and f32 tiles of
    the ``splits`` widths split in K. Among fills within STREAM_FILL_TOLERANCE of the best: unsplit
    (the widest), then a K pair (the widest: its DSMEM exchange replaces the reduction kernel), then
    a split (in the order given). Returns the best fill and the plan (None when nothing fits a wave)."""
    options = []  # (fill, kind, preference, splits, name)
    for w in unsplit:
        if _ceil(n, w) <= sms:
            options.append((wave_fill(_ceil(n, w), sms), 0, -w, 1, f"gemm_bf16_{tile_m}x{w}_c1x1"))
    for w in pairs if k >= K_PAIR_MIN_K else ():
        if 2 * _ceil(n, w) <= sms:
            options.append((wave_fill(2 * _ceil(n, w), sms), 1, -w, 1, f"gemm_bf16_{tile_m}x{w}_c1x1_k2"))
    for i, w in enumerate(splits):
        s = wave_splits(_ceil(n, w), k, sms)
        if s > 1:
            options.append((wave_fill(_ceil(n, w) * s, sms), 2, i, s, f"gemm_f32_{tile_m}x{w}_c1x1"))
    if not options:
        return 0.0, None
    top = max(o[0] for o in options)
    _, _, _, s, name = min((o for o in options if o[0] >= STREAM_FILL_TOLERANCE * top), key=lambda o: o[1:3])
    return top, GemmPlan(VARIANTS_BY_NAME[name], s)


def _stream_plan(m: int, n: int, k: int, sms: int) -> GemmPlan:
    """64-row tiles streaming the weights. At M <= 64 (one row of tiles, ``_one_row_plan``):
    STREAM_WIDTHS unsplit, STREAM_PAIR_WIDTHS in K pairs (from STREAM_K_PAIR_MIN_M), SPLIT_WIDTHS
    split in K. Widths that cut N into about one tile per SM keep every SM streaming (chains of one
    GEMM with its weights prefetched, graph-replayed at M = 1, H200 2026-12-01: 4B.qkv 48 wide 10.0
    µs against 11.7 for 48 CTAs of 64x128; 4B.gate_up 160 wide 24.5 against 28.3 for 76 of 64x256;
    8B.gate_up 192 wide 48.4 against 53.7; 4B.down 80 wide x 4 splits 15.1 against 15.8 for 128
    wide x 6; 8B.o 128 wide x 4 10.9 against 11.3 for 96 wide x 3, an equal fill).
    From M = 65 (two rows) the 2026-11-30 rule: 64x256 or 64x128, and a width whose tiles alone
    number UNSPLIT_MIN_CTAS streams unsplit at K <= UNSPLIT_MAX_K (a split adds the fp32 partials
    and their reduction, which only a long K earns back)."""
    if m <= 64:
        pairs = STREAM_PAIR_WIDTHS if m >= STREAM_K_PAIR_MIN_M else ()
        _, plan = _one_row_plan(64, n, k, sms, STREAM_WIDTHS, pairs, SPLIT_WIDTHS)
        return plan or GemmPlan(VARIANTS_BY_NAME["gemm_bf16_64x256_c1x1"])  # N wider than a wave of 256
    rows = _ceil(m, 64)
    options = []  # (fill, splits, width)
    for tile_n in (256, 128):
        tiles = rows * _ceil(n, tile_n)
        splits = 1 if tiles >= UNSPLIT_MIN_CTAS and k <= UNSPLIT_MAX_K else wave_splits(tiles, k, sms)
        options.append((wave_fill(tiles * splits, sms), splits, tile_n))
    unsplit = [o for o in options if o[1] == 1]
    if unsplit:  # among unsplit widths: the fuller wave, 64x256 on a tie
        options = unsplit
    top = max(fill for fill, _, _ in options)
    _, splits, tile_n = min((o for o in options if o[0] >= FILL_TOLERANCE * top), key=lambda o: (o[1], -o[2]))
    out = "f32" if splits > 1 else "bf16"
    return GemmPlan(VARIANTS_BY_NAME[f"gemm_{out}_64x{tile_n}_c1x1"], splits)


def _small_m_plan(m: int, n: int, k: int, sms: int) -> GemmPlan:
    """64-row tiles streaming the weights (``_stream_plan``). From M = 65 two rows of them read the
    weights twice over L2; one row of 128-row tiles reads them once. Where one of its options fills
    ROW_128_MIN_FILL of a wave (``_one_row_plan``; H200, 2026-12-01 19:29 UTC, M = 96 / 128:
    4B.qkv 128 tiles of 48 11.7 / 11.6 µs against 13.1 / 13.3; 4B o / down 128x80 in 4 splits
    10.2 / 18.8 at M = 96 against 11.9 / 21.4; 8B o / down 64 K pairs of 128x64 13.6 / 31.8
    against 15.3 / 35.0 for 128x128 pairs; 8B.qkv 17.5 against 19.8): that, split in K only where
    the stream would split too. Else 128x128 K pairs where they are enough CTAs at K >= 4096, else
    192-row tiles split in K where the stream would split anyway (sweeps of 2026-12-01, 07:36 UTC)."""
    stream = _stream_plan(m, n, k, sms)
    if m <= 64:
        return stream
    fill, row = _one_row_plan(128, n, k, sms, ROW_128_WIDTHS, ROW_128_PAIR_WIDTHS, ROW_128_SPLIT_WIDTHS)
    if row is not None and fill >= ROW_128_MIN_FILL and (row.splits == 1 or stream.splits > 1):
        return row  # (a K split only where the stream would split anyway: short K does not earn it)
    if k >= K_PAIR_MIN_K and 2 * _ceil(n, 128) >= UNSPLIT_MIN_CTAS:
        return GemmPlan(VARIANTS_BY_NAME["gemm_bf16_128x128_c1x1_k2"])
    return (_row_192_plan(m, n, k, sms) if stream.splits > 1 else None) or stream


def _row_192_plan(m: int, n: int, k: int, sms: int) -> GemmPlan | None:
    """One row of 192-row tiles (three consumer warpgroups): the weights stream once, a third of
    the rows wasted at worst. The fullest single wave among the bf16 widths (no split) and
    192x64 / 192x128 split in K; fewer splits, then the wider tile, among near-equal fills.
    None when no option fills ROW_192_MIN_FILL of a wave. qkv (N = 6144) takes 96 unsplit 192x64
    tiles: 14.5 / 21.9 µs (4B / 8B at M = 160) against 16.7 / 25.1 for two rows of 128x128 tiles,
    which had beaten 192x128 in two K splits by 13-25% (2026-12-01, 07:36 and 17:36 UTC)."""
    options = [(wave_fill(_ceil(n, w), sms), 1, w) for w in (256, 192, 160, 128, 64)]
    for w in (128, 64):
        splits = wave_splits(_ceil(n, w), k, sms)
        if splits > 1:
            options.append((wave_fill(_ceil(n, w) * splits, sms), splits, w))
    top = max(fill for fill, _, _ in options)
    if top < ROW_192_MIN_FILL:
        return None
    _, splits, tile_n = min((o for o in options if o[0] >= FILL_TOLERANCE * top), key=lambda o: (o[1], -o[2]))
    out = "f32" if splits > 1 else "bf16"
    return GemmPlan(VARIANTS_BY_NAME[f"gemm_{out}_192x{tile_n}_c1x1"], splits)


def _tile_plan(m: int, n: int, k: int, sms: int, residual: bool) -> GemmPlan:
    """128-row tiles: the width with the least wave-quantised work; a 2x1 cluster over an even
    number of M-tiles (or 8 and more), A multicast to an N-pair for 160.
    From M = 256 and K = 4096 a cluster pair of CTAs per tile, each on half of K (summed over
    distributed shared memory), competes on the same cost with a 20% surcharge: it wins where whole
    tiles leave much of a wave idle (N = 2560 / 4096 at M = 256-512: up to 1.9x, 2026-12-01).
    Two rows of tiles (M = 193-256) may also take 128x96 (qkv: 128 CTAs) and 80-wide pairs at
    K <= K_PAIR_80_MAX_K (4B o: 128 CTAs), one CTA per SM."""
    def cost(tile_n: int) -> float:
        return _ceil(_ceil(m, 128) * _ceil(n, tile_n), sms) * tile_n / TILE_EFFICIENCY[tile_n]

    def pair_cost(tile_n: int) -> float:  # two CTAs per tile, each half of K
        return _ceil(2 * _ceil(m, 128) * _ceil(n, tile_n), sms) * tile_n / TILE_EFFICIENCY[tile_n] / 2 * K_PAIR_COST

    # 320 first: on equal costs it was 2-5% faster than 256 (4B gate_up at M = 1000 / 2048, 4B o at
    # 8192); no residual twin (R's tile would take two of its four ring stages)
    widths = ((320, 256, 192, 160, 128) + ((96,) if m <= NARROW_96_MAX_M else ()) + (80,) if m >= WIDE_192_MIN_M
              else (256, 128))
    tile_n = min((w for w in widths if not (residual and w > 256)), key=cost)
    if m >= K_PAIR_MIN_M and k >= K_PAIR_MIN_K:
        pairs = ((192, 160, 128) if residual else (256, 192, 160, 128)) + ((80,) if k <= K_PAIR_80_MAX_K else ())
        pair_n = min(pairs, key=pair_cost)  # (no 256 residual twin)
        if pair_cost(pair_n) < cost(tile_n):
            return GemmPlan(VARIANTS_BY_NAME[f"gemm_bf16_128x{pair_n}_c1x1_k2"])
    if tile_n in (160, 80):  # the A tile is the larger one: multicast it to an N-pair (swept 2026-12-01)
        return GemmPlan(VARIANTS_BY_NAME[f"gemm_bf16_128x{tile_n}_c1x2"])
    # a 2x1 cluster pads an odd number of M-tiles with a whole row of empty tiles: only from 8 on,
    # and only where that cluster is built (not for 96)
    paired = _ceil(m, 128) % 2 == 0 or _ceil(m, 128) >= 8
    cluster = 2 if paired and f"gemm_bf16_128x{tile_n}_c2x1" in VARIANTS_BY_NAME else 1
    return GemmPlan(VARIANTS_BY_NAME[f"gemm_bf16_128x{tile_n}_c{cluster}x1"])


@functools.lru_cache(maxsize=4096)  # called on every launch; a pure function of its arguments
def plan_gemm(m: int, n: int, k: int, sms: int = H200_SMS, residual: bool = False) -> GemmPlan:
    """Pick the variant (and K splits) for ``D[m, n] = A[m, k]·B[n, k]ᵀ`` (+ R with ``residual``:
    the same tile, its residual twin; tuned on the H200). Memoised: after changing the tuning
    constants of this module, call ``plan_gemm.cache_clear()``."""
    if m <= 64 or (m <= STREAM_MAX_M and _ceil(m, 64) * _ceil(n, 256) < sms):
        plan = _small_m_plan(m, n, k, sms)
    else:
        plan = _row_192_plan(m, n, k, sms) if STREAM_MAX_M < m <= ROW_192_MAX_M else None
        plan = plan or _tile_plan(m, n, k, sms, residual)
    variant = plan.variant
    if takes_producer_warpgroup(variant):
        variant = replace(variant, ws=True)
    if residual and variant.out == "bf16":
        variant = replace(variant, residual=True)
    if m <= A_BOX_ROWS:
        variant = VARIANTS_BY_NAME.get(replace(variant, a_rows=A_BOX_ROWS).name, variant)
    return GemmPlan(variant, plan.splits)


def plan_fp8_gemm(m: int, n: int, k: int, sms: int = H200_SMS) -> GemmVariant:
    """The FP8 variant for ``D[m, n] = A[m, k]·B[n, k]ᵀ``: 64x128 tiles up to M = 64 (a weight stream), else
    128x128, or 128x64 where that fills a wave better (narrow N, few row tiles); 128x128 tiles pair along M in
    2x1 clusters (the weight tile multicast) unless that pads a row of empty tiles onto an odd count below 8
    (the bf16 plan's rule)."""
    if m <= 64:
        return FP8_VARIANTS_BY_NAME["gemm_fp8_64x128_c1x1_ws"]
    m_tiles = _ceil(m, 128)
    wide, narrow = m_tiles * _ceil(n, 128), m_tiles * _ceil(n, 64)
    if wave_fill(narrow, sms) > wave_fill(wide, sms) * 1.25 and narrow <= sms:
        return FP8_VARIANTS_BY_NAME["gemm_fp8_128x64_c1x1_ws"]
    if m_tiles % 2 == 0 or m_tiles >= 8:
        return FP8_VARIANTS_BY_NAME["gemm_fp8_128x128_c2x1_ws"]
    return FP8_VARIANTS_BY_NAME["gemm_fp8_128x128_c1x1_ws"]
