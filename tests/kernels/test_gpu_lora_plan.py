"""The host side of the GPU LoRA ops (no GPU needed): the token -> slot map grouped as the kernels read it,
the slices' bounds lora_expand.cu takes, and the plan sizing the slots of the real Qwen3-4B shape."""
from __future__ import annotations

import os

import numpy as np

from engine.executor.gpu_lora_layout import FUSED_MAX_ROWS, extra_rows, fused_site, padded_rank
from engine.executor.gpu_lora_ops import GpuLoRAOps, group_by_slot, shrink_chunk, shrink_floats, slice_bounds

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "configs")


def test_tokens_are_grouped_by_slot_in_batch_order():
    slots = np.array([2, -1, 0, 2, 2, -1, 0, 1, 2], np.int32)
    order, starts = group_by_slot(slots, 4)
    assert starts.tolist() == [0, 2, 3, 7, 7, 9]                  # the last group: rows without an adapter
    assert order.tolist() == [2, 6, 7, 0, 3, 4, 8, 1, 5]
    for s in range(4):
        assert (slots[order[starts[s]:starts[s + 1]]] == s).all()
    order, starts = group_by_slot(np.full(5, -1, np.int32), 3)      # padded rows only (graph warm-up)
    assert order.tolist() == [0, 1, 2, 3, 4] and starts.tolist() == [0, 0, 0, 0, 5]


def test_shrink_splits_k_for_small_steps_only():
    """lora_shrink.cu's chunk of K: 256 (most CTAs) for a decode step, growing with the rows until the
    grid is full, at most KC_MAX; the partials buffer holds every step size's chunks."""
    assert shrink_chunk(9728, 16, 1) == 256 and shrink_chunk(2560, 48, 32) == 256
    assert shrink_chunk(9728, 16, 8192) == 1024 and shrink_chunk(2560, 48, 8192) == 1024
    sizes = [shrink_chunk(9728, 16, r) for r in range(1, 8193)]
    assert sizes == sorted(sizes)
    need = max(-(-9728 // shrink_chunk(9728, 16, r)) * r * 16 for r in range(1, 8193))
    assert shrink_floats(9728, 16, 8192) == need


def test_slice_bounds():
    assert slice_bounds((4096, 1024, 1024)) == (4096, 5120)
    assert slice_bounds((9728, 9728)) == (9728, 19456)
    assert slice_bounds((2560,)) == (2560, 2560)
    assert padded_rank(1) == 8 and padded_rank(16) == 16 and padded_rank(20) == 24


def test_plan_sizes_the_lora_slots_of_qwen3_4b():
    """Qwen3-4B, 4 slots of rank 16: A and B of the 4 x 36 sites, ~66 MB a slot (A in the rows after each
    site's weight; every site small enough for the extended product; its shapes planned for the CuTe GEMM);
    none without LoRA."""
    from engine.executor.gpu_plan import DeviceInfo, gpu_plan
    from engine.executor.options import options_of
    from engine.model_config import ModelConfig
    from engine.models.registry import build_model

    model = build_model(ModelConfig.from_file(os.path.join(CONFIGS, "qwen3-4b")))
    device = DeviceInfo(name="H200", num_sms=132, total_memory=141 << 30, compute_capability="90")
    plan = gpu_plan(options_of(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192, max_loras=4,
                               max_lora_rank=16), model, device)
    sites = dict(plan.lora_sites)
    assert len(sites) == 4 * 36 and sites["layers.0.qkv_proj"].slices == (4096, 1024, 1024)
    per_slot = sum((len(s.slices) * 16 * s.k + s.n * 16) * 2 for s in sites.values())
    assert 60e6 < per_slot < 70e6
    buffers = {b.name: b for b in GpuLoRAOps.buffers(plan)}
    assert buffers["layers.3.gate_up_proj.b"].shape == (4, 2 * 9728, 16) and "layers.3.qkv_proj.a" not in buffers
    assert "layers.3.gate_up_proj.a" not in buffers
    partials = max(shrink_floats(s.k, len(s.slices) * 16, 8192) for s in sites.values())
    assert buffers["shrunk"].shape == (partials,) and partials * 4 < 8 << 20
    assert buffers["slot_map"].shape == (2 * 8192 + 4 + 2,)
    assert buffers["wide"].shape == (FUSED_MAX_ROWS * (2 * 9728 + 4 * 2 * 16),)
    a_bytes = sum(extra_rows(n, sites, plan.options) * s.k * 2 for n, s in sites.items())
    assert a_bytes == 4 * sum(len(s.slices) * 16 * s.k * 2 for n, s in sites.items())
    assert GpuLoRAOps.nbytes(plan) + a_bytes >= 4 * per_slot
    assert all(fused_site(s, plan.options) for s in sites.values())
    assert (6144 + 4 * 3 * 16, 2560) in plan.linear_shapes and (2560 + 4 * 16, 9728) in plan.linear_shapes
    assert (2 * 9728 + 4 * 2 * 16, 2560) in plan.linear_shapes
    wide = gpu_plan(options_of(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192, max_loras=32,
                               max_lora_rank=64), model, device)     # 32 slots x 64 ranks
    wide_sites = dict(wide.lora_sites)          # q/k/v: 6144 extra rows on 6144 (shrink + expand), gate/up: 4096 on 19456
    assert not fused_site(wide_sites["layers.0.qkv_proj"], wide.options)
    assert fused_site(wide_sites["layers.0.gate_up_proj"], wide.options)
    off = gpu_plan(options_of(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192), model, device)
    assert off.lora_sites == () and GpuLoRAOps.nbytes(off) == 0
