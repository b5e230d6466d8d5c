"""The GEMM plan (no GPU): every shape gets a built variant and a valid split count, and the rules
tuned on the H200 (configs.py, bench/results/kernels.md) hold as rules."""
from dataclasses import replace

import pytest

from openinfer_kernels.cute.configs import (FILL_TOLERANCE, GEMM_VARIANTS, H200_SMS, K_PAIR_MIN_K, K_TILE, MAX_SPLITS,
                                  ROW_128_MIN_FILL, ROW_128_PAIR_WIDTHS, ROW_128_SPLIT_WIDTHS, ROW_128_WIDTHS,
                                  ROW_192_MAX_M, ROW_192_MIN_FILL, SPLIT_WIDTHS, STREAM_FILL_TOLERANCE,
                                  STREAM_K_PAIR_MIN_M, STREAM_MAX_M, STREAM_PAIR_WIDTHS, STREAM_WIDTHS, UNSPLIT_MAX_K,
                                  UNSPLIT_MIN_CTAS, VARIANTS_BY_NAME, _stream_plan, plan_gemm, split_count, wave_fill,
                                  wave_splits)

QWEN = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (6144, 4096), (4096, 4096),
        (24576, 4096), (4096, 12288)]


@pytest.mark.parametrize("n,k", QWEN + [(200, 328), (151936, 2560), (64, 64)])
@pytest.mark.parametrize("m", [1, 8, 17, 32, 64, 65, 128, 129, 160, 192, 193, 255, 256, 512, 1000, 8192])
def test_plan_is_valid(m, n, k):
    plan = plan_gemm(m, n, k)
    assert plan.variant in GEMM_VARIANTS and not plan.variant.grouped
    assert split_count(k, plan.splits) == plan.splits
    assert (plan.splits > 1) == (plan.variant.out == "f32")
    assert plan.variant.cluster_m == 1 or -(-m // plan.variant.tile_m) >= 2  # a 2x1 cluster pairs two M-tiles
    if STREAM_MAX_M < m <= ROW_192_MAX_M:  # one row of 192-row tiles, or 128-row tiles unsplit
        assert plan.variant.tile_m == 192 or (plan.variant.tile_m == 128 and plan.splits == 1)
    elif m > STREAM_MAX_M:
        assert plan.variant.tile_m == 128 and plan.splits == 1


def _row_192_fills(n: int, k: int) -> list[tuple[float, int, int]]:
    """(fill, splits, width) of every one-row 192 option: the bf16 widths, 192x128 / 192x64 split."""
    options = [(wave_fill(-(-n // w)), 1, w) for w in (256, 192, 160, 128, 64)]
    for w in (128, 64):
        s = wave_splits(-(-n // w), k)
        if s > 1:
            options.append((wave_fill(-(-n // w) * s), s, w))
    return options


@pytest.mark.parametrize("n,k", QWEN + [(200, 328), (151936, 2560)])
@pytest.mark.parametrize("m", [129, 160, 192])
def test_row_192_plan_fills_one_wave(m, n, k):
    """128 < M <= 192: one row of 192-row tiles when one of its options fills ROW_192_MIN_FILL of a
    wave (the fullest, or one with fewer splits within FILL_TOLERANCE of it); else 128-row tiles."""
    plan = plan_gemm(m, n, k)
    options = _row_192_fills(n, k)
    top = max(f for f, _, _ in options)
    if plan.variant.tile_m == 128:
        assert top < ROW_192_MIN_FILL
        return
    v, s = plan.variant, plan.splits
    fill = wave_fill(-(-n // v.tile_n) * s)
    assert (fill, s, v.tile_n) in options and fill >= FILL_TOLERANCE * top
    assert not [o for o in options if o[0] >= FILL_TOLERANCE * top and o[1] < s], "an option with fewer splits fits"


def _one_row_options(n, k, unsplit, pairs, splits):
    """(fill, kind, splits, width) of every one-row option: unsplit widths within a wave, K pairs
    (two CTAs per tile, K >= K_PAIR_MIN_K) within a wave, split widths with the most splits a wave holds."""
    tiles = lambda w: -(-n // w)  # noqa: E731
    options = [(wave_fill(tiles(w)), "unsplit", 1, w) for w in unsplit if tiles(w) <= H200_SMS]
    options += [(wave_fill(2 * tiles(w)), "pair", 1, w) for w in pairs if k >= K_PAIR_MIN_K and 2 * tiles(w) <= H200_SMS]
    options += [(wave_fill(tiles(w) * t), "split", t, w) for w in splits for t in [wave_splits(tiles(w), k)] if t > 1]
    return options


_ORDER = ("unsplit", "pair", "split")


def _best_one_row(options):
    """The rule's choice: the first kind (unsplit, K pair, split) with an option within
    STREAM_FILL_TOLERANCE of the fullest wave; unsplit and pairs the widest, splits in list order."""
    top = max(o[0] for o in options)
    near = [o for o in options if o[0] >= STREAM_FILL_TOLERANCE * top]
    kind = min((o[1] for o in near), key=_ORDER.index)
    return [o for o in near if o[1] == kind]


def _as_option(plan, n):
    v, s = plan.variant, plan.splits
    kind = "pair" if v.k_split == 2 else "split" if s > 1 else "unsplit"
    return (wave_fill(-(-n // v.tile_n) * (2 if kind == "pair" else s)), kind, s, v.tile_n)


def _check_one_row_choice(plan, n, options):
    """The plan is one of the options of the first kind near the fullest wave: the widest for
    unsplit tiles and pairs, the first width listed for splits."""
    best = _best_one_row(options)
    got = _as_option(plan, n)
    assert got in best, f"{plan.variant.name}/S{plan.splits}: not among {best}"
    if got[1] != "split":
        assert got[3] == max(o[3] for o in best)


@pytest.mark.parametrize("n,k", QWEN + [(200, 328), (151936, 2560), (2056, 1032), (64, 64), (3072, 4096)])
@pytest.mark.parametrize("m", [1, 8, 16, 17, 33, 64])
def test_one_row_stream_fills_the_wave(m, n, k):
    """M <= 64: one row of 64-row tiles, the width (and K split or K pair) whose CTAs fill one
    wave best; among fills within STREAM_FILL_TOLERANCE of it, unsplit before a K pair (from
    STREAM_K_PAIR_MIN_M) before a split, and no more splits than fit the wave."""
    plan = plan_gemm(m, n, k)
    assert plan.variant.tile_m == 64
    pairs = STREAM_PAIR_WIDTHS if m >= STREAM_K_PAIR_MIN_M else ()
    options = _one_row_options(n, k, STREAM_WIDTHS, pairs, SPLIT_WIDTHS)
    if not options:  # wider than a wave of 64x256: unsplit, several waves
        assert (plan.variant.tile_n, plan.splits) == (256, 1) and -(-n // 256) > H200_SMS
        return
    _check_one_row_choice(plan, n, options)


@pytest.mark.parametrize("n,k", QWEN + [(200, 328), (2056, 1032), (5120, 328), (3072, 4096)])
@pytest.mark.parametrize("m", [65, 96, 128])
def test_one_row_of_128_fills_the_wave(m, n, k):
    """M = 65-128 (where 64-row tiles would not fill the SMs twice over): one row of 128-row tiles
    when one of its options fills ROW_128_MIN_FILL of a wave (a K split only where the 64-row
    stream would split too); the choice among them as for M <= 64."""
    plan = plan_gemm(m, n, k)
    if 2 * -(-n // 256) >= H200_SMS:  # the 64-row tiles alone fill the SMs: wide 128-row tiles
        return
    options = _one_row_options(n, k, ROW_128_WIDTHS, ROW_128_PAIR_WIDTHS, ROW_128_SPLIT_WIDTHS)
    applies = bool(options) and max(o[0] for o in options) >= ROW_128_MIN_FILL
    if applies and _best_one_row(options)[0][1] == "split":
        applies = _stream_plan(m, n, k, H200_SMS).splits > 1
    if applies:
        assert plan.variant.tile_m == 128
        _check_one_row_choice(plan, n, options)
    else:  # the earlier rules: 64-row streams, 192-row tiles split in K, or 128x128 K pairs
        assert plan.variant.tile_m != 128 or plan.variant.name == "gemm_bf16_128x128_c1x1_k2"


@pytest.mark.parametrize("n,k", QWEN + [(200, 328), (151936, 2560)])
@pytest.mark.parametrize("m", [100, 128])
def test_streaming_plan_fills_one_wave(m, n, k):
    """Small M: 64-row tiles whose CTAs fit one wave, with as many splits as still fit, and a fill
    within FILL_TOLERANCE of the other tile width's best single wave; unsplit where the tiles alone
    number UNSPLIT_MIN_CTAS (K <= UNSPLIT_MAX_K)."""
    plan = plan_gemm(m, n, k)
    if plan.variant.tile_m == 192:  # M = 65-128: one row of 192-row tiles where the stream would split
        assert 64 < m <= 128 and plan.splits > 1
        return
    if plan.variant.tile_m == 128:  # one row of 128-row tiles (test_one_row_of_128_fills_the_wave),
        assert m > 64                # or wide tiles where the 64x256 tiles alone fill the SMs
        if -(-m // 64) * -(-n // 256) < H200_SMS and plan.variant.k_split == 2 and plan.variant.tile_n == 128:
            assert k >= 4096 and 2 * -(-n // 128) >= UNSPLIT_MIN_CTAS  # the 128x128 K-pair fallback
        return
    v, s = plan.variant, plan.splits
    tiles = -(-m // 64) * -(-n // v.tile_n)
    if s == 1 and tiles >= UNSPLIT_MIN_CTAS and k <= UNSPLIT_MAX_K:  # enough CTAs: no split
        return
    k_tiles = -(-k // K_TILE)
    one_more = [t for t in range(s + 1, MAX_SPLITS + 1)
                if tiles * t <= H200_SMS and k_tiles >= 2 * t and split_count(k, t) == t]
    assert not one_more, f"{v.name}/S{s}: {one_more} would still fit one wave"
    assert tiles * s <= H200_SMS or s == 1
    other = 128 if v.tile_n == 256 else 256
    other_tiles = -(-m // 64) * -(-n // other)
    best_other = max(wave_fill(other_tiles * t) for t in range(1, MAX_SPLITS + 1)
                     if t == 1 or (other_tiles * t <= H200_SMS and k_tiles >= 2 * t and split_count(k, t) == t))
    assert wave_fill(tiles * s) >= FILL_TOLERANCE * best_other


@pytest.mark.parametrize("m,n,k,expect,residual", [
    # the choices the 2026-11-30 H200 sweep favoured (bench/results/kernels.md), as rules
    (1, 6144, 2560, "gemm_bf16_64x48_c1x1_ws_a16/S1", False),    # qkv: 128 tiles of 48, one per SM, unsplit
    (1, 2560, 4096, "gemm_f32_64x80_c1x1_a16/S4", False),     # o: 32 tiles of 80 x 4 splits (20 of 128 x 6: 91%)
    (32, 6144, 4096, "gemm_bf16_64x48_c1x1_ws/S1", False),   # 8B qkv too
    (64, 4096, 12288, "gemm_bf16_64x64_c1x1_k2/S1", False),  # 8B down: 64 K pairs of 64 wide (128 x 4 splits as full)
    (16, 4096, 12288, "gemm_f32_64x128_c1x1_a16/S4", False),   # ... below STREAM_K_PAIR_MIN_M: 128 wide x 4
    (1, 4096, 4096, "gemm_f32_64x128_c1x1_a16/S4", False),     # 8B o likewise
    (1, 24576, 4096, "gemm_bf16_64x192_c1x1_ws_a16/S1", False),  # 8B gate_up: 128 tiles of 192
    (96, 4096, 4096, "gemm_bf16_128x64_c1x1_k2/S1", False),   # M = 65-128: one row of 128-row tiles, 64 K pairs (8B o)
    (128, 4096, 12288, "gemm_bf16_128x64_c1x1_k2/S1", False),  # ... 8B down
    (96, 2560, 9728, "gemm_f32_128x80_c1x1/S4", False),    # 4B down: 32 tiles of 80 x 4 splits
    (96, 6144, 2560, "gemm_bf16_128x48_c1x1_ws/S1", False),  # qkv: 128 tiles of 48
    (128, 6144, 4096, "gemm_bf16_128x48_c1x1_ws/S1", False),  # ... 8B too (an unsplit fill before K pairs)
    (96, 5120, 328, "gemm_bf16_64x128_c1x1_ws/S1", False),  # short K: no 128-row split where the stream has none
    (8, 2560, 4096, "gemm_f32_64x80_c1x1_a16/S4", False),      # o: as at M = 1
    (32, 4096, 12288, "gemm_bf16_64x64_c1x1_k2_res/S1", True),  # 8B down (residual): the K pair's twin
    (32, 19456, 2560, "gemm_bf16_64x160_c1x1_ws/S1", False),  # gate_up: 122 tiles of 160 (76 of 256)
    (128, 2560, 9728, "gemm_f32_128x80_c1x1/S4", False),   # M = 128: one row of tiles streams the weights once
    (64, 2560, 9728, "gemm_f32_64x80_c1x1/S4", False),     # M = 64: one row of 64-row tiles
    (128, 19456, 2560, "gemm_bf16_128x160_c1x2_ws/S1", False),  # ... unless the 64-row tiles fill a wave
    (512, 2560, 4096, "gemm_bf16_128x80_c1x2_ws/S1", False),  # narrow N: 128 tiles of 80 fill the wave (K pairs: 0.97x)
    (512, 4096, 4096, "gemm_bf16_128x128_c2x1_ws/S1", False),  # 128 tiles of 128 fill the wave: no K pair
    (640, 2560, 4096, "gemm_bf16_128x128_c1x1_ws/S1", False),  # no K pair (2 x 5 x 16 CTAs > a wave); 5 M-tiles: no 2x1 cluster
    (384, 6144, 2560, "gemm_bf16_128x160_c1x2_ws/S1", False),  # 128x160 / 192 from M = 256 (timed at 256-640)
    (384, 4096, 12288, "gemm_bf16_128x192_c1x1_k2/S1", False),  # 96 tiles of 128 -> 132 half-K CTAs of 192
    (256, 6144, 2560, "gemm_bf16_128x96_c1x1_ws/S1", False),  # two rows of 64 tiles of 96: one wave, one per SM
    (256, 6144, 4096, "gemm_bf16_128x96_c1x1_ws/S1", False),  # ... 8B too, before 128x192 K pairs
    (256, 2560, 4096, "gemm_bf16_128x80_c1x1_k2/S1", False),  # 2 x 32 K pairs of 80: one wave
    (256, 2560, 9728, "gemm_bf16_128x128_c1x1_k2/S1", False),  # ... not at long K (4B down)
    (512, 6144, 4096, "gemm_bf16_128x192_c2x1_ws/S1", False),  # 32 x 4 tiles of 192: one wave (2026-12-01 sweep)
    (2048, 2560, 4096, "gemm_bf16_128x320_c2x1/S1", False),  # 128 tiles of 320: one wave (160: 2 waves)
    (2048, 2560, 4096, "gemm_bf16_128x160_c1x2_ws_res/S1", True),  # no 320 residual twin: 160, A multicast
    (1000, 6144, 2560, "gemm_bf16_128x192_c2x1_ws/S1", False),  # 2 waves of 192 beat 3 of 160
    (512, 19456, 2560, "gemm_bf16_128x320_c2x1/S1", False),  # 1.85 waves of 320 beat 3.7 of 160 and 2.3 of 256
    (8192, 2560, 4096, "gemm_bf16_128x320_c2x1/S1", False),  # many waves: the widest tile (320 on a tie with 256)
    (8192, 24576, 4096, "gemm_bf16_128x256_c2x1_ws/S1", False),  # 256 where 320 quantises worse
    # 128 < M <= 192 (the 2026-12-01 sweeps with A read to whole tiles)
    (160, 2560, 4096, "gemm_f32_192x64_c1x1/S3", False),    # one row of 192: 40 tiles x 3 splits
    (192, 4096, 12288, "gemm_f32_192x64_c1x1/S2", False),   # 64 tiles x 2 = 15 x 8 of 128: fewer splits
    (160, 19456, 2560, "gemm_bf16_192x160_c1x1/S1", False),  # 122 tiles of 160: one wave, no split
    (192, 24576, 4096, "gemm_bf16_192x192_c1x1/S1", False),  # 128 tiles of 192
    (160, 6144, 2560, "gemm_bf16_192x64_c1x1/S1", False),   # qkv: 96 unsplit 192x64 tiles beat two rows of 128x128
    (224, 2560, 4096, "gemm_bf16_128x80_c1x1_k2/S1", False),  # K pairs from M = 129
])
def test_plan_follows_the_tuned_rules(m, n, k, expect, residual):
    plan = plan_gemm(m, n, k, residual=residual)
    assert f"{plan.variant.name}/S{plan.splits}" == expect


def test_wave_helpers():
    assert wave_fill(132) == 1.0 and wave_fill(66) == 0.5 and wave_fill(133) == pytest.approx(133 / 264)
    assert wave_splits(24, 2560) == 5       # 5 x 24 = 120 <= 132 < 6 x 24
    assert wave_splits(10, 320) == 2        # 5 k-tiles: at least 2 per split
    assert wave_splits(200, 4096) == 1
    assert all(split_count(k, wave_splits(t, k)) == wave_splits(t, k) for t in (1, 3, 7) for k in (1032, 9728))


@pytest.mark.parametrize("k", [8, 64, 72, 328, 1032, 2560, 9728])
@pytest.mark.parametrize("asked", [1, 2, 3, 4, 5, 7, 16])
def test_split_count_never_leaves_a_split_empty(k, asked):
    k_tiles = -(-k // K_TILE)
    s = split_count(k, asked)
    per = -(-k_tiles // s)
    assert 1 <= s <= min(asked, k_tiles)
    assert (s - 1) * per < k_tiles <= s * per  # the last split has at least one k-tile


def test_residual_plans_have_a_residual_twin():
    """A planned K pair of 128x256 has no residual twin (no room for R): residual plans avoid it."""
    for m in (256, 384, 512, 700):
        for n, k in ((2560, 4096), (4096, 12288), (6144, 4096), (19456, 4096)):
            plan = plan_gemm(m, n, k, residual=True)
            assert plan.variant.residual and plan.variant.name in VARIANTS_BY_NAME


@pytest.mark.parametrize("n,k", QWEN + [(200, 328), (151936, 2560)])
@pytest.mark.parametrize("m", [1, 32, 129, 512, 2048])
def test_plain_tiles_take_a_producer_warpgroup(m, n, k):
    """bf16 64- and 128-row tiles up to 256 wide run warp-specialised; split-K, K pairs, 192-row
    and 320-wide tiles do not. A residual plan is the same tile's residual twin (no 320 twin)."""
    v = plan_gemm(m, n, k).variant
    assert v.ws == (v.out == "bf16" and v.k_split == 1 and v.tile_m in (64, 128) and v.tile_n <= 256)
    r = plan_gemm(m, n, k, residual=True).variant
    if v.tile_n <= 256:
        assert r == (replace(v, residual=True) if v.out == "bf16" else v)
    else:
        assert r.residual and r.tile_n <= 256

