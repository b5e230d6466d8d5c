"""raw_cuda/w4_grouped_gemm.cu (the 4-bit experts' prefill GEMM) through its host launch (quant/ops.py) on the host
emulation: every real row of moe_align's expert-grouped layout times its expert's bf16-rounded dequantized weights
(float32 accumulation), in every 4-bit format; padding rows and padding tiles untouched; a tile_m it cannot take
refused. GPU speed and the device's own numerics: tests/kernels/test_gpu_quant_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest

from harness.quant_cases import W4_KINDS, grouped_layout, random_w4
from openinfer_kernels.quant import w4_formats as fmt
from openinfer_kernels.quant.w4_layout import pack_w4
from openinfer_kernels.quant.ops import W4Weight
from test_decode_kernels_emulated import assert_bf16_close
from test_deltanet_kernels_emulated import host
from test_quant_w4 import EmulatedQuantOps
from test_rope_cache_emulated import bf16, f32, rb

NAN_BF16 = 0x7FC0


@pytest.mark.parametrize("kind", W4_KINDS)
@pytest.mark.parametrize("N,K,tile_m,counts", [(136, 384, 64, [70, 0, 5, 64]),      # a tile past N, S odd
                                               (40, 160, 128, [3, 130, 0, 17])])     # K past whole steps
def test_w4_grouped_gemm_matches_the_dequantized_product(kind, N, K, tile_m, counts):
    rng = np.random.default_rng(N + K + len(kind))
    group = 32
    w = random_w4(rng, kind, N, K, group, (len(counts),))
    tile_expert, row_token = grouped_layout(counts, tile_m, spare_tiles=1)
    rows = row_token.size
    a = bf16(rng.standard_normal((rows, K)))
    out = host(np.full((rows, N), NAN_BF16, np.uint16))
    EmulatedQuantOps().w4_grouped_gemm(host(a), W4Weight.upload(pack_w4(w), host), host(tile_expert),
                                       host(row_token), out, tile_m)
    got, deq = np.asarray(out), rb(fmt.dequant(w))
    real = row_token >= 0
    for t, e in enumerate(tile_expert):
        rows_t = np.arange(t * tile_m, (t + 1) * tile_m)
        mine = rows_t[real[rows_t]]
        if mine.size:
            assert_bf16_close(got[mine], rb(f32(a[mine]) @ deq[e].T), f"{kind} tile {t} expert {e}")
    assert np.all(got[~real] == NAN_BF16), "padding rows written"


def test_w4_grouped_gemm_refuses_tiles_it_cannot_take():
    rng = np.random.default_rng(0)
    w = W4Weight.upload(pack_w4(random_w4(rng, "bf16", 16, 128, 32, (2,))), host)
    a, out = host(np.zeros((96, 128), np.uint16)), host(np.zeros((96, 16), np.uint16))
    with pytest.raises(ValueError, match="multiple of 64"):
        EmulatedQuantOps().w4_grouped_gemm(a, w, host(np.zeros(3, np.int32)), host(np.zeros(96, np.int32)), out, 32)
