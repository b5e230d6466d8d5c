"""The decode-kernel switch of the GPU executor parses on the CPU: what turns each new path on, and
clear errors for what it does not know."""
from __future__ import annotations

import pytest

from engine.executor.gpu import DEFAULT_GEMV_MAX_M, parse_decode_kernels
from engine.executor.gpu_ops import MAX_DECODE_SPLITS, attention_splits, decode_attention_fits


@pytest.mark.parametrize("spec,expected", [
    ("", (False, 0)), ("none", (False, 0)), ("attention", (True, 0)), ("gemv", (False, DEFAULT_GEMV_MAX_M)),
    ("gemv:8", (False, 8)), ("attention, gemv:32", (True, 32)), ("all", (True, DEFAULT_GEMV_MAX_M)),
    ("ALL", (True, DEFAULT_GEMV_MAX_M)),
])
def test_parse_decode_kernels(spec, expected):
    assert parse_decode_kernels(spec) == expected


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
    assert attention_splits(1, 8, 256, MAX_DECODE_SPLITS) == 8          # >= 32 keys per split
    assert attention_splits(1, 8, 4096, MAX_DECODE_SPLITS) == 33        # fill the SMs twice
    assert attention_splits(16, 8, 4096, MAX_DECODE_SPLITS) == 3
    assert attention_splits(17, 8, 4096, MAX_DECODE_SPLITS) == 1        # 136 CTAs fill the SMs once
    assert attention_splits(32, 8, 4096, MAX_DECODE_SPLITS) == 1
