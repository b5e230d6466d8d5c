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

    @property
    def name(self) -> str:
        return f"gemm_{self.out}_{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}"


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


def valid_splits(k: int, max_splits: int = 16) -> list[int]:
    """Split counts S where every split is a whole number of 16-byte rows: K % S == 0, (K/S) % 8 == 0,
    and each split keeps at least four 64-wide k-tiles."""
    return [s for s in range(1, max_splits + 1) if k % s == 0 and (k // s) % 8 == 0 and k // s >= 256]


def choose_splits(tiles: int, k: int, sms: int = H200_SMS) -> int:
    """The S (from valid_splits) that minimises waves per unit of K, i.e. ceil(tiles·S / sms) / S."""
    best, best_cost = 1, float(_ceil(tiles, sms))
    for s in valid_splits(k):
        cost = _ceil(tiles * s, sms) / s
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


# Tuned on the H200 (bench/results/kernels.md): small M streams the weights with a 64-row tile
# and split-K to fill the SMs; mid M uses 128x128; large M the 128x256 two-warpgroup tile with a
# 2x1 cluster multicasting B.
SPLITK_MAX_M = 64


def plan_gemm(m: int, n: int, k: int, sms: int = H200_SMS) -> GemmPlan:
    """Pick the variant (and K splits) for ``D[m, n] = A[m, k]·B[n, k]ᵀ``."""
    if m <= SPLITK_MAX_M:
        variant = VARIANTS_BY_NAME["gemm_f32_64x128_c1x1"]
        splits = choose_splits(_ceil(n, variant.tile_n), k, sms)
        if splits > 1:
            return GemmPlan(variant, splits)
        return GemmPlan(VARIANTS_BY_NAME["gemm_bf16_64x128_c1x1"])
    if m <= 256:
        return GemmPlan(VARIANTS_BY_NAME["gemm_bf16_128x128_c1x1"])
    return GemmPlan(VARIANTS_BY_NAME["gemm_bf16_128x256_c2x1"])
