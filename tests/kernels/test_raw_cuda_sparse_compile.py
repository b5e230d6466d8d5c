"""The MoE / MLA kernels compile with NVRTC for sm_90 at the shapes GpuMLAOps builds them for (mla_decode.cu
is specialized per kv_lora_rank and qk_rope_head_dim): DeepSeek-V2 / V2-Lite and the tiny test models."""
from __future__ import annotations

import os

import pytest

from openinfer_kernels.raw_cuda import KERNEL_DIR
from test_raw_cuda_compile import _compile


@pytest.mark.parametrize("kv_rank,rope_dim", [(512, 64), (32, 8), (128, 16)])
def test_mla_decode_compiles_for_each_shape(kv_rank, rope_dim):
    _compile(os.path.join(KERNEL_DIR, "mla_decode.cu"), f"KV_RANK={kv_rank}", f"ROPE_DIM={rope_dim}")


def _defines(path: str) -> dict[str, str]:
    with open(path) as f:
        rows = (line.split("//")[0].split(None, 2) for line in f)
        return {p[1]: p[2].strip() for p in rows if len(p) == 3 and p[0] == "#define"}


def test_mla_decode_launcher_matches_the_kernel():
    """gpu_mla_ops's copies of mla_decode.cu's constants, its grids (every head group filled at batch 1,
    16 heads per CTA once the grid fills the SMs) and its dynamic shared memory (two CTAs per H200 SM at
    V2's 16 heads per CTA)."""
    from engine.executor.gpu_mla_ops import MLA_CHUNK, MLA_MAX_GROUP, MLA_MAX_SPLITS, mla_decode_shape, mla_decode_smem
    d = _defines(os.path.join(KERNEL_DIR, "mla_decode.cu"))
    assert int(d["MAX_G"]) == MLA_MAX_GROUP and int(d["MAX_SPLITS"]) == MLA_MAX_SPLITS
    assert d["CHUNK"] == "(NWARPS * KPW)" and int(d["NTHREADS"]) // 32 * int(d["KPW"]) == MLA_CHUNK
    assert mla_decode_shape(1, 16, 16, 132) == (16, 1)
    assert mla_decode_shape(8, 16, 16, 132) == (16, 8)
    assert mla_decode_shape(32, 9, 16, 132) == (9, 16)
    assert mla_decode_shape(300, 1, 16, 132) == (1, 16)
    assert mla_decode_shape(1, 16, 128, 132) == (16, 8)
    assert mla_decode_shape(1, 64, 3, 132) == (32, 1)
    assert 2 * (mla_decode_smem(64, 512, MLA_MAX_GROUP) + 5 * 1024) <= 228 * 1024
