"""bf16 bits (uint16, how the GPU holds weights and activations) and float32 values, on CuPy arrays (or numpy:
`cp` is the array module), for the ops that compute in float32 array ops (DeepSeek-V4's, gpu_dsv4_ops.py, and
the limited SwiGLU of its experts, gpu_moe_ops.py)."""
from __future__ import annotations

import numpy as np

INTERLEAVE_ROWS = 8     # gate_up rows interleaved in blocks of 8 (memory/weight_upload.py)


# On CuPy each conversion is one elementwise kernel (as array ops it was 2 and 6 launches: in a DeepSeek-V4 decode
# graph ~90 nodes of ~3 µs, 2026-12-07 ncu profile); on numpy (the host emulation) the same arithmetic as array ops.
_kernels: dict = {}


def elementwise(cp, name: str, in_params: str, out_params: str, body: str):
    """CuPy's ElementwiseKernel `openinfer_<name>`, made once; None on an array module without them (numpy)."""
    if not hasattr(cp, "ElementwiseKernel"):
        return None
    if name not in _kernels:
        _kernels[name] = cp.ElementwiseKernel(in_params, out_params, body, f"openinfer_{name}")
    return _kernels[name]


def bf16_to_f32(cp, a):
    """bf16 bits (uint16) -> float32 values; a float32 array is returned as it is."""
    if a.dtype == np.float32:
        return a
    k = elementwise(cp, "bf16_to_f32", "uint16 x", "float32 y", "y = __uint_as_float((unsigned)x << 16)")
    return k(a) if k is not None else (a.astype(cp.uint32) << 16).view(cp.float32)


def f32_to_bf16(cp, a):
    """float32 -> bf16 bits (uint16, round to nearest even), contiguous."""
    k = elementwise(cp, "f32_to_bf16", "float32 x", "uint16 y",
                    "const unsigned u = __float_as_uint(x); y = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)")
    if k is not None:
        return k(cp.asarray(a, dtype=cp.float32))
    u = cp.ascontiguousarray(a, dtype=cp.float32).view(cp.uint32)
    return ((u + (cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1)))) >> 16).astype(cp.uint16)


def split_gate_up(cp, g, interleaved: bool):
    """gate_up values g [T, 2I] as [gate | up], undoing the upload's interleave of 8-row blocks."""
    if not interleaved:
        return g
    T, two_i = g.shape
    blocks = g.reshape(T, two_i // (2 * INTERLEAVE_ROWS), 2, INTERLEAVE_ROWS)
    return cp.concatenate([blocks[:, :, 0].reshape(T, -1), blocks[:, :, 1].reshape(T, -1)], axis=1)
