"""raw_cuda/fp8_grouped_gemm.cu (the FP8 experts' prefill GEMM) through its host launch (quant/ops.py) on the host
emulation: every real row of moe_align's expert-grouped layout is its expert's W8A8 product (fp8_ref.w8a8_exact:
e4m3 products summed per 128-block, promoted with the block or channel scales), padding rows and padding tiles
untouched, tiles it cannot take refused. The kernel's swizzle, its one-block-ahead staging and weight loads and the
64-row blocks of a tile are all on the path: a swapped chunk, a stale block or a wrong row's scale fails here. GPU
speed and the device's own numerics: tests/kernels/test_gpu_quant_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest

from harness.quant_cases import grouped_layout, random_fp8_weight
from openinfer_kernels.quant import fp8_ref
from test_decode_kernels_emulated import assert_bf16_close
from test_deltanet_kernels_emulated import host
from test_quant_fp8 import activations
from test_quant_w4 import EmulatedQuantOps
from test_rope_cache_emulated import f32, rb

NAN_BF16 = 0x7FC0


@pytest.mark.parametrize("channel", [False, True])
@pytest.mark.parametrize("N,K,tile_m,counts", [(200, 640, 128, [70, 0, 5, 128]),    # a CTA past N, 5 blocks
                                               (136, 256, 64, [3, 64, 0, 17])])     # 8-column tail, 2 blocks
def test_fp8_grouped_gemm_is_the_w8a8_product(channel, N, K, tile_m, counts):
    rng = np.random.default_rng(N + K + channel)
    weights = [random_fp8_weight(rng, N, K, channel) for _ in counts]
    w = np.stack([a.view(np.uint8) for a, _ in weights])
    ws = np.stack([b for _, b in weights])
    tile_expert, row_token = grouped_layout(counts, tile_m, spare_tiles=1)
    rows = row_token.size
    q, s = fp8_ref.quantize_activations(f32(activations(rng, rows, K)))
    out = host(np.full((rows, N), NAN_BF16, np.uint16))
    EmulatedQuantOps().fp8_grouped_gemm(host(q.view(np.uint8)), host(s), host(w), host(ws), host(tile_expert),
                                        host(row_token), out, tile_m)
    got, real = np.asarray(out), row_token >= 0
    for t, e in enumerate(tile_expert):
        mine = np.arange(t * tile_m, (t + 1) * tile_m)
        mine = mine[real[mine]]
        if mine.size:
            want = fp8_ref.w8a8_exact(q[mine], s[:, mine], weights[e][0], weights[e][1], channel)
            assert_bf16_close(got[mine], rb(want), f"channel={channel} tile {t} expert {e}")
    assert np.all(got[~real] == NAN_BF16), "padding rows written"


def test_fp8_grouped_gemm_refuses_what_it_cannot_take():
    rng = np.random.default_rng(0)
    w, ws = random_fp8_weight(rng, 16, 128, False)
    args = (host(w.view(np.uint8)[None]), host(ws[None]), host(np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match="multiple of 64"):
        EmulatedQuantOps().fp8_grouped_gemm(host(np.zeros((96, 128), np.uint8)), host(np.zeros((1, 96), np.float32)),
                                            args[0], args[1], args[2], host(np.zeros(96, np.int32)),
                                            host(np.zeros((96, 16), np.uint16)), 32)
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        EmulatedQuantOps().fp8_grouped_gemm(host(np.zeros((64, 128), np.uint8)), host(np.zeros((1, 66), np.float32)),
                                            args[0], args[1], host(np.zeros(1, np.int32)), host(np.zeros(64, np.int32)),
                                            host(np.zeros((64, 16), np.uint16)), 64)
