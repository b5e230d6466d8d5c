"""The host side of the MoE and MLA GPU ops (no GPU needed): the grouped GEMM's row bound holds for any
routing, the MLA expansion maps every context position to its cache slot, the plan sizes both lines'
buffers from the real DeepSeek-V2-Lite and Qwen3-30B-A3B configs, and stacked expert gate_up weights
interleave expert by expert."""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.gpu_mla_ops import expansion
from engine.executor.gpu_moe_ops import expert_rows, expert_tile_m, expert_tiles
from openinfer_kernels.cute.moe import group_by_expert

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "configs")


@pytest.mark.parametrize("experts,top_k", [(6, 3), (64, 6), (128, 8)])
def test_expert_tiles_bound_every_routing(experts, top_k):
    """The fixed grid (expert_tiles) holds the tiles group_by_expert needs, for spread and skewed routings;
    the bound is met exactly by one token per expert (every group a tile of its own)."""
    rng = np.random.default_rng(experts)
    for tokens in (1, 2, 7, 33, 300, 2048):
        tile_m = expert_tile_m(tokens, top_k, experts)
        bound = expert_tiles(tokens, top_k, experts, tile_m)
        for skew in (0, 1, 4):
            pool = experts if skew == 0 else min(experts, top_k * skew)
            ids = np.stack([rng.permutation(pool)[:top_k] for _ in range(tokens)])
            assert group_by_expert(ids, experts, tile_m).tile_expert.size <= bound
        assert expert_tiles(tokens, top_k, experts, tile_m) * tile_m <= expert_rows(tokens, top_k, experts)
    assert expert_tiles(1, top_k, experts, 64) == top_k


def test_mla_expansion_maps_positions_to_slots():
    batch = ModelBatch.build([SeqStep(0, list(range(20)), 0, [3, 5], False),
                              SeqStep(1, [7], 37, [0, 1, 2], False), SeqStep(2, [1, 2], 14, [9], False)])
    rows, src, tables = expansion(batch, max_blocks=4, rows_cap=1 << 10)
    assert rows == 16 * (2 + 3 + 1) and tables.shape == (3, 4)
    for b, s in enumerate(batch.seqs):
        n = int(batch.context_lens[b])
        p = np.arange(n)
        got = src[tables[b, p // 16] * 16 + p % 16]
        np.testing.assert_array_equal(got, np.asarray(s.block_table)[p // 16] * 16 + p % 16)
    assert (src == -1).sum() == rows - int(batch.context_lens.sum())
    assert expansion(batch, 4, rows_cap=16 * 5) is None


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b"])
def test_plan_sizes_the_sparse_buffers_of_the_real_configs(name):
    from engine.executor.gpu_ops import GpuOps
    from engine.executor.gpu_plan import DeviceInfo, gpu_plan
    from engine.executor.options import options_of
    from engine.model_config import ModelConfig
    from engine.models.registry import build_model

    model = build_model(ModelConfig.from_file(os.path.join(CONFIGS, name)))
    device = DeviceInfo(name="H200", num_sms=132, total_memory=141 << 30, compute_capability="90")
    plan = gpu_plan(options_of(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192), model, device)
    assert plan.experts == model.expert_shape and (plan.mla is not None) == (name == "deepseek-v2-lite")
    assert all(n % 8 == 0 for n, _ in plan.linear_shapes)          # routers (float32 logits) are not planned
    sparse = GpuOps.families_nbytes(plan)
    assert 0.2e9 < sparse < 3e9, sparse                              # a fraction of the 80+ GB left for KV
    assert GpuOps.nbytes(plan) > sparse


def test_stacked_gate_up_interleaves_each_expert():
    from engine.executor.gpu_gemm import interleave_gate_up

    w = np.arange(3 * 32 * 5, dtype=np.uint16).reshape(3, 32, 5)
    stacked = interleave_gate_up(w)
    for e in range(3):
        np.testing.assert_array_equal(stacked[e], interleave_gate_up(w[e]))
