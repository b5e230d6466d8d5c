"""The compiled kernel variants and the table that picks one for a GEMM shape (no DSL import).

Shared by the build (what to compile) and the launcher (what to call). A variant's ``name`` is its
symbol prefix in the shared library and its key in the manifest.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def name(self) -> str:
        kind = "grouped" if self.grouped else "gemm"
        return f"{kind}_{self.out}_{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}"


GEMM_VARIANTS: tuple[GemmVariant, ...] = (
    GemmVariant(128, 256, 1, 1),
    GemmVariant(128, 256, 2, 1),
    GemmVariant(128, 128, 1, 1),
    GemmVariant(128, 128, 2, 1),
    GemmVariant(64, 128, 1, 1),
    GemmVariant(64, 256, 1, 1),
    GemmVariant(64, 64, 1, 1, "f32"),
    GemmVariant(64, 128, 1, 1, "f32"),
    GemmVariant(64, 256, 1, 1, "f32"),
    GemmVariant(64, 128, 1, 1, grouped=True),
    GemmVariant(128, 128, 1, 1, grouped=True),
)
REDUCE_NAME = "splitk_reduce"
VARIANTS_BY_NAME = {v.name: v for v in GEMM_VARIANTS}


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


def choose_splits(m: int, n: int, k: int, tile_n: int, sms: int = H200_SMS) -> int:
    """Split count minimising a bandwidth model of the small-M GEMM: the weight read at the
    fraction of HBM that ``tiles·S`` CTAs on ``sms`` SMs can pull (wave quantisation, under-filled
    chip), plus writing and re-reading the ``S·M·N`` float32 partials."""
    tiles = _ceil(n, tile_n)
    best, best_cost = 1, None
    for s in range(1, MAX_SPLITS + 1):
        if _ceil(k, K_TILE) < s * MIN_K_TILES_PER_SPLIT or split_count(k, s) != s:
            continue
        ctas = tiles * s
        efficiency = ctas / (_ceil(ctas, sms) * sms)
        cost = 2 * (n * k + m * k) / efficiency + (8 * m * n * s if s > 1 else 0)
        if best_cost is None or cost < best_cost * 0.97:  # prefer fewer splits unless clearly better
            best, best_cost = s, cost
    return best


# Small M streams the weights with a 64-row tile and split-K to fill the SMs; mid M uses 128x128;
# large M the 128x256 two-warpgroup tile with a 2x1 cluster multicasting B. These choices follow
# the CUTLASS Hopper defaults and the model above; bench/kernels.py --sweep times every
# alternative per shape to retune them on the H200.
SPLITK_MAX_M = 64


def plan_gemm(m: int, n: int, k: int, sms: int = H200_SMS) -> GemmPlan:
    """Pick the variant (and K splits) for ``D[m, n] = A[m, k]·B[n, k]ᵀ``."""
    if m <= SPLITK_MAX_M:
        variant = VARIANTS_BY_NAME["gemm_f32_64x128_c1x1"]
        splits = choose_splits(m, n, k, variant.tile_n, sms)
        if splits > 1:
            return GemmPlan(variant, splits)
        return GemmPlan(VARIANTS_BY_NAME["gemm_bf16_64x128_c1x1"])
    if m <= 256:
        return GemmPlan(VARIANTS_BY_NAME["gemm_bf16_128x128_c1x1"])
    return GemmPlan(VARIANTS_BY_NAME["gemm_bf16_128x256_c2x1"])
