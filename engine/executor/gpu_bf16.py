"""bf16 bits (uint16, how the GPU holds weights and activations) and float32 values, on CuPy arrays (or numpy:
`cp` is the array module), for the ops that compute in float32 array ops (DeepSeek-V4's, gpu_dsv4_ops.py, and
the limited SwiGLU of its experts, gpu_moe_ops.py)."""
from __future__ import annotations

import numpy as np

INTERLEAVE_ROWS = 8     # gate_up rows interleaved in blocks of 8 (memory/weight_upload.py)


def bf16_to_f32(cp, a):
    """bf16 bits (uint16) -> float32 values; a float32 array is returned as it is."""
    if a.dtype == np.float32:
        return a
    return (a.astype(cp.uint32) << 16).view(cp.float32)


def f32_to_bf16(cp, a):
    """float32 -> bf16 bits (uint16, round to nearest even), contiguous."""
    u = cp.ascontiguousarray(a, dtype=cp.float32).view(cp.uint32)
    return ((u + (cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1)))) >> 16).astype(cp.uint16)


def split_gate_up(cp, g, interleaved: bool):
    """gate_up values g [T, 2I] as [gate | up], undoing the upload's interleave of 8-row blocks."""
    if not interleaved:
        return g
    T, two_i = g.shape
    blocks = g.reshape(T, two_i // (2 * INTERLEAVE_ROWS), 2, INTERLEAVE_ROWS)
    return cp.concatenate([blocks[:, :, 0].reshape(T, -1), blocks[:, :, 1].reshape(T, -1)], axis=1)
