"""The KV cache's stored format, vLLM's --kv-cache-dtype: "auto" / "bfloat16" keep the executor's own
(float32 in numpy, bf16 on the GPU); "fp8" / "fp8_e4m3" store e4m3 bytes, one per value, so the same memory
holds twice the blocks of a bf16 pool.

FP8 follows vLLM: one per-tensor scale per layer and plane (k_scale for K, v_scale for V; MLA's one latent
plane takes k_scale), read from the checkpoint where it has them (engine/loader/kv_scales.py), else 1.0
(vLLM's default; no calibration). Stored = e4m3(x / scale), saturating at ±448 as vLLM's
scaled_fp8_conversion does; read = e4m3 · scale, in float32. "fp8_e5m2" is refused: the kernels here read
e4m3 only (fp8.cuh), and e5m2's 2-bit mantissa is the format vLLM itself keeps for scale-free caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_MAX = 448.0                    # the largest finite e4m3 (float8_e4m3fn) value
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def is_fp8(kv_cache_dtype: str) -> bool:
    """Whether a --kv-cache-dtype stores e4m3; raises ValueError naming the flag for one not served."""
    if kv_cache_dtype == "fp8_e5m2":
        raise ValueError("--kv-cache-dtype fp8_e5m2: this engine's attention kernels read e4m3 only; "
                         "use fp8 (= fp8_e4m3) or auto")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of auto, bfloat16, fp8, fp8_e4m3, got {kv_cache_dtype!r}")
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


def quantize_e4m3(x: np.ndarray, scale) -> np.ndarray:
    """e4m3 of x / scale, saturated to ±448 (float8_e4m3fn has no infinity: a plain cast would give NaN)."""
    y = np.asarray(x, np.float32) / np.float32(scale)
    return np.clip(y, -FP8_MAX, FP8_MAX).astype(E4M3)


def dequantize_e4m3(q: np.ndarray, scale) -> np.ndarray:
    """float32 values of e4m3 q times scale."""
    return q.astype(np.float32) * np.float32(scale)


@dataclass(frozen=True)
class KVFormat:
    """fp8: the pool stores e4m3 bytes. scales: float32 [layers, planes] (k_scale, v_scale of each KV layer;
    ones without checkpoint scales); None when fp8 is off."""
    fp8: bool = False
    scales: np.ndarray | None = None

    @classmethod
    def of(cls, kv_cache_dtype: str, layers: int, planes: int, scales: np.ndarray | None = None) -> "KVFormat":
        """The format of a --kv-cache-dtype for a pool of layers x planes (scales: the checkpoint's, or None)."""
        if not is_fp8(kv_cache_dtype):
            return cls()
        s = np.ones((layers, planes), np.float32) if scales is None else np.asarray(scales, np.float32)
        if s.shape != (layers, planes) or not (np.isfinite(s).all() and (s > 0).all()):
            raise ValueError(f"KV cache scales must be positive and finite, [{layers}, {planes}], got {s.tolist()}")
        return cls(True, s)

    def itemsize(self, own: int) -> int:
        """Bytes one stored value takes (own: the executor's unquantized itemsize)."""
        return 1 if self.fp8 else own

    def describe(self, own: str) -> str:
        """The startup log's words for it (own: the executor's own KV dtype)."""
        if not self.fp8:
            return f"KV cache {own}"
        s = self.scales
        if bool((s == 1).all()):
            return "KV cache fp8 e4m3, per-tensor scales 1.0 (none in the checkpoint)"
        planes = [f"{name} {float(s[:, i].min()):.4g}..{float(s[:, i].max()):.4g}" for i, name in
                  zip(range(s.shape[1]), ("k_scale", "v_scale"))]
        return "KV cache fp8 e4m3, the checkpoint's per-tensor scales: " + ", ".join(planes)

    def store(self, values: np.ndarray, layer: int, plane: int) -> np.ndarray:
        """What the pool stores for float32 values of (layer, plane)."""
        return quantize_e4m3(values, self.scales[layer, plane]) if self.fp8 else values

    def load(self, stored: np.ndarray, layer: int, plane: int) -> np.ndarray:
        """float32 values of what the pool stores for (layer, plane)."""
        return dequantize_e4m3(stored, self.scales[layer, plane]) if self.fp8 else stored

    def plane_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of a KV layer: what a read multiplies the stored e4m3 values by (1.0, 1.0 unquantized)."""
        return (float(self.scales[layer, 0]), float(self.scales[layer, 1])) if self.fp8 else (1.0, 1.0)

    def host_dtype(self):
        """The numpy pool's dtype (float32 unquantized)."""
        return E4M3 if self.fp8 else np.dtype(np.float32)
