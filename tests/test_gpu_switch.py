"""The decode-kernel and GEMM-library switches of the GPU executor parse on the CPU: what turns each
path on, and clear errors for what they do not know."""
from __future__ import annotations

import pytest

from engine.executor.env import gpu_tuning_from_env
from engine.executor.gpu_gemm import ALL_ROWS, CUTE_AUTO_MAX_M, cute_rows
from engine.executor.gpu_ops import MAX_DECODE_SPLITS, attention_splits, decode_attention_fits
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
