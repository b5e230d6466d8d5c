"""The decode-kernel and GEMM-library switches of the GPU executor parse on the CPU: what turns each
path on, and clear errors for what they do not know."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.executor.options import gpu_tuning_from_env
from engine.executor.gpu_gemm import ALL_ROWS, CUTE_AUTO_MAX_M, cute_rows
from engine.executor.attention_grid import MAX_DECODE_SPLITS, MAX_SPLITS, attention_splits, decode_attention_fits
from engine.executor.options import DEFAULT_GEMV_MAX_M, parse_decode_kernels

H200_SMS = 132


@pytest.mark.parametrize("spec,expected", [
    ("", (False, 0)), ("none", (False, 0)), ("attention", (True, 0)), ("gemv", (False, DEFAULT_GEMV_MAX_M)),
    ("gemv:8", (False, 8)), ("attention, gemv:32", (True, 32)), ("all", (True, DEFAULT_GEMV_MAX_M)),
    ("ALL", (True, DEFAULT_GEMV_MAX_M)),
])
def test_parse_decode_kernels(spec, expected):
    assert parse_decode_kernels(spec) == expected


def test_parse_decode_kernels_default_rows():
    """The executor passes the GEMV's default rows (1 where the CuTe GEMM serves decode)."""
    assert parse_decode_kernels("all", 1) == (True, 1)
    assert parse_decode_kernels("gemv", 1) == (False, 1)
    assert parse_decode_kernels("attention,gemv:4", 1) == (True, 4)


@pytest.mark.parametrize("backend,rows", [
    ("auto", CUTE_AUTO_MAX_M), ("AUTO", CUTE_AUTO_MAX_M), ("cute", ALL_ROWS), (True, ALL_ROWS),
    ("cublas", 0), (False, 0),
])
def test_gemm_backend_rows(backend, rows):
    assert cute_rows(backend) == rows


def test_gemm_backend_from_environment():
    assert cute_rows(gpu_tuning_from_env({}).gemm) == CUTE_AUTO_MAX_M  # the default
    assert cute_rows(gpu_tuning_from_env({"OPENINFER_GEMM": "cublas"}).gemm) == 0
    with pytest.raises(ValueError, match="cutlass"):
        gpu_tuning_from_env({"OPENINFER_GEMM": "cutlass"})


@pytest.mark.parametrize("spec,word", [("flash", "flash"), ("gemv:x", "gemv:x")])
def test_parse_decode_kernels_rejects(spec, word):
    with pytest.raises(ValueError, match=word):
        parse_decode_kernels(spec)


def test_decode_attention_fits_rule():
    """q and the accumulators of paged_decode.cu: group x 16-byte slices per lane <= 8."""
    assert decode_attention_fits(4, 128) and decode_attention_fits(8, 128) and decode_attention_fits(8, 64)
    assert decode_attention_fits(4, 256) and decode_attention_fits(1, 16) and decode_attention_fits(8, 96)
    assert not decode_attention_fits(16, 128) and not decode_attention_fits(16, 64)
    assert not decode_attention_fits(4, 100) and not decode_attention_fits(8, 256)


def test_decode_splits_fill_the_gpu():
    """paged_decode.cu, Qwen3 (8 KV heads): batch 1 at 256 keys 8 splits of 32 keys, at 4096 keys 33 (>= 2 CTAs
    per SM); from batch 17 the (token, head) CTAs fill the SMs and take 1 split."""
    assert attention_splits(1, 8, 256, MAX_DECODE_SPLITS, H200_SMS) == 8          # >= 32 keys per split
    assert attention_splits(1, 8, 4096, MAX_DECODE_SPLITS, H200_SMS) == 33        # fill the SMs twice
    assert attention_splits(16, 8, 4096, MAX_DECODE_SPLITS, H200_SMS) == 3
    assert attention_splits(17, 8, 4096, MAX_DECODE_SPLITS, H200_SMS) == 1        # 136 CTAs fill the SMs once
    assert attention_splits(32, 8, 4096, MAX_DECODE_SPLITS, H200_SMS) == 1
    # head groups count as rows: batch 1, 8 KV heads x 2 groups = 16 rows -> 17 splits (272 CTAs)
    assert attention_splits(1, 8, 4096, MAX_DECODE_SPLITS, H200_SMS, groups=2) == 17
    assert attention_splits(1, 8, 256, MAX_DECODE_SPLITS, H200_SMS, groups=2) == 8
    assert attention_splits(9, 8, 4096, MAX_DECODE_SPLITS, H200_SMS, groups=2) == 1    # 144 rows


def test_decode_heads_per_cta_splits_small_grids():
    """paged_decode.cu takes 2 query heads a CTA while the (token, KV head) rows are under a quarter of
    the SMs: Qwen3-4B (8 KV heads, group 4) to batch 4, Qwen3-30B-A3B (4 KV heads, group 8) to batch 8;
    the whole group beyond, and for groups of 1, 2 or odd."""
    from engine.executor.attention_grid import decode_heads_per_cta

    assert [decode_heads_per_cta(t, 8, 4, H200_SMS) for t in (1, 4, 5, 32)] == [2, 2, 4, 4]
    assert [decode_heads_per_cta(t, 4, 8, H200_SMS) for t in (1, 8, 9)] == [2, 2, 8]
    assert decode_heads_per_cta(1, 8, 2, H200_SMS) == 2 and decode_heads_per_cta(1, 4, 1, H200_SMS) == 1
    assert decode_heads_per_cta(1, 2, 7, H200_SMS) == 7


def test_rope_heads_per_warp_follow_the_piece_form():
    """qk_norm_rope_cache.cu serves 32 / (D/8) heads a warp where D/8 is a power of two from 2 to 32 (16-byte
    pieces), else a head a warp; GpuOps sizes its head groups by it."""
    from engine.executor.attention_grid import rope_heads_per_warp

    assert [rope_heads_per_warp(d) for d in (16, 32, 64, 128, 256)] == [16, 8, 4, 2, 1]
    assert [rope_heads_per_warp(d) for d in (8, 48, 80, 96, 192, 512, 130)] == [1] * 7


def test_decode_splits_follow_the_head_groups():
    """GpuOps.splits counts paged_decode.cu's head groups as rows: Qwen3-30B-A3B at batch 1 in a decode
    graph (max context 40960) takes 17 splits x 4 KV heads x 4 groups, no longer 64 x 4."""
    from bench.ab_switches import ABGpuOps

    class Probe(ABGpuOps):
        def __init__(self):
            self.num_heads, self.head_dim, self.fast_attention = 32, 128, True
            self.shared = SimpleNamespace(num_sms=H200_SMS)

    ops = Probe()
    assert ops.splits(1, 4, 40960) == 17 and ops._heads_per_cta(1, 4) == 2
    assert ops.splits(64, 4, 40960) == 1 and ops._heads_per_cta(64, 4) == 8
    ops.decode_heads = 8                                         # the benchmarks' override: whole groups
    assert ops.splits(1, 4, 40960) == 64
    ops.fast_attention = False                                   # paged_attention_split: no head groups
    assert ops.splits(1, 4, 40960) == MAX_SPLITS
