"""The weight upload's copy plan, applied to a numpy stand-in for device memory: packed parts land in
their rows with no host concatenation, gate_up in gemv.cu's interleaved layout (interleave_gate_up),
float checkpoints become bf16, and chunks never exceed the staging buffer."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.executor.gpu_gemm import interleave_gate_up
from memory.packed_weight import PackedWeight
from memory.weight_upload import copies_of, stage, weight_copies


def apply(copies, device: np.ndarray, max_bytes: int) -> None:
    """What the copy stream does with each staged chunk (device: a uint8 array at address 0)."""
    staging = np.zeros(max_bytes, np.uint8)
    for c in copies:
        assert c.nbytes <= max_bytes
        stage(c, staging)
        for r in range(c.height):
            device[c.dst + r * c.dst_pitch:c.dst + r * c.dst_pitch + c.width] = staging[r * c.width:(r + 1) * c.width]


def bf16(a):
    return np.asarray(a).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
@pytest.mark.parametrize("interleave", [False, True])
def test_parts_land_in_their_rows(chunk, interleave):
    rng = np.random.default_rng(0)
    gate, up = bf16(rng.standard_normal((48, 24))), bf16(rng.standard_normal((48, 24)))
    w = PackedWeight([gate, up])
    device = np.zeros(w.size * 2 + 64, np.uint8)
    apply(copies_of(w.parts, 32, interleave, max_bytes=chunk), device, max(chunk, 8 * 24 * 2))
    got = device[32:32 + w.size * 2].view(ml_dtypes.bfloat16).reshape(w.shape)
    want = np.concatenate([gate, up])
    np.testing.assert_array_equal(got, interleave_gate_up(want) if interleave else want)
    assert not device[:32].any() and not device[32 + w.size * 2:].any()


def test_float32_checkpoints_become_bf16_and_vectors_go_whole():
    rng = np.random.default_rng(1)
    norm = rng.standard_normal(40).astype(np.float32)
    matrix = rng.standard_normal((7, 40)).astype(np.float16)
    device = np.zeros((40 + 7 * 40) * 2, np.uint8)
    apply(copies_of([norm], 0, False) + copies_of([matrix], 80, False, max_bytes=160), device, 1 << 12)
    np.testing.assert_array_equal(device[:80].view(ml_dtypes.bfloat16), bf16(norm))
    np.testing.assert_array_equal(device[80:].view(ml_dtypes.bfloat16).reshape(7, 40), bf16(matrix))


def test_packed_weight_is_an_array_where_one_is_needed():
    a, b = np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32)
    w = PackedWeight([a, b])
    assert w.shape == (3, 3) and w.size == 9 and w.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(w), np.concatenate([a, b]))
    assert np.asarray(w, np.float16).dtype == np.float16


def test_interleave_needs_two_equal_parts_of_whole_blocks():
    with pytest.raises(ValueError, match="interleave"):
        copies_of([np.zeros((12, 4), np.float32)] * 2, 0, True)


def test_vector_parts_of_different_lengths_follow_each_other():
    """A packed bias (q, k, v of different lengths) lands part after part (a row offset per part would
    overlap them)."""
    q, k, v = (np.arange(n, dtype=np.float32) + 100 * i for i, n in enumerate((64, 32, 32)))
    device = np.zeros(128 * 2, np.uint8)
    apply(copies_of([q, k, v], 0, False), device, 1 << 12)
    np.testing.assert_array_equal(device.view(ml_dtypes.bfloat16), bf16(np.concatenate([q, k, v])))


def test_stacked_expert_gate_up_is_interleaved_per_expert():
    rng = np.random.default_rng(2)
    w = bf16(rng.standard_normal((3, 32, 8)))           # [experts, 2I, H]
    device = np.zeros(w.size * 2, np.uint8)
    apply(weight_copies(w, 0, True), device, 1 << 12)
    np.testing.assert_array_equal(device.view(ml_dtypes.bfloat16).reshape(w.shape), interleave_gate_up(w))
    whole = bf16(rng.standard_normal((32, 8)))          # a 2D gate_up stored fused in the checkpoint
    device = np.zeros(whole.size * 2, np.uint8)
    apply(weight_copies(whole, 0, True), device, 1 << 12)
    np.testing.assert_array_equal(device.view(ml_dtypes.bfloat16).reshape(whole.shape), interleave_gate_up(whole))
