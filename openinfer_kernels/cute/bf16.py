"""bf16 on the GPU without a bf16 dtype: CuPy ``uint16`` arrays holding the bit patterns.

``to_bf16`` rounds float32 to nearest-even, ``from_bf16`` widens exactly. Works on CuPy or NumPy
arrays (the module of the input is used), so tests and benchmarks share one definition.
"""
from __future__ import annotations


def _xp(x):
    return type(x).__module__.split(".")[0] == "cupy" and __import__("cupy") or __import__("numpy")


def to_bf16(x):
    """float32 array → uint16 bf16 bits, round to nearest even (NaN stays NaN)."""
    xp = _xp(x)
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
    nan = (bits & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, xp.uint32(0x7FC0), rounded).astype(xp.uint16)


def from_bf16(x):
    """uint16 bf16 bits → float32 (exact)."""
    xp = _xp(x)
    return (xp.ascontiguousarray(x).astype(xp.uint32) << 16).view(xp.float32)
