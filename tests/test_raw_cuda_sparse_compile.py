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
