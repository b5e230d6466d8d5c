"""Rotary position embedding tables (neox style), shared by every model line and executor.

`rope_inv_freq` gives the per-pair inverse frequencies with the config's scaling (linear,
llama3, yarn) folded in; `rope_cos_sin` expands them into float32 [positions, D/2] tables
(yarn's attention factor folded into cos/sin), computed in float32 as transformers does.

Partial rotary (`partial_rotary_factor` < 1, e.g. Qwen3.5): only rot = D · factor dims rotate. The
frequencies are computed over rot dims and padded with zeros to D/2 pairs: a zero-frequency pair
is left exactly as it is (cos 1, sin 0), so every kernel keeps rotating pairs (i, i + D/2). A model
line whose checkpoint rotates pairs (i, i + rot/2) of the first rot dims permutes its q and k head
dims so that those pairs sit at (i, i + D/2) (engine/models/qwen3_5.py).
"""
from __future__ import annotations

import math

import numpy as np

from engine.model_config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(cfg: ModelConfig, dim: int, s: dict) -> tuple[np.ndarray, float]:
    base = cfg.rope_theta
    orig = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = s.get("factor") or cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attn)


def partial_rotary_factor(cfg: ModelConfig) -> float:
    """The fraction of head_dim that rotates (config.json: rope_parameters or top level; default 1)."""
    params = cfg.raw.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.raw.get("partial_rotary_factor", 1.0)))


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * partial_rotary_factor(cfg))


def rope_inv_freq(cfg: ModelConfig, dim: int | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [dim/2], attention_factor applied to cos and sin). dim: the rotary dimensions
    of an MLA head (qk_rope_head_dim); by default head_dim, of which partial_rotary_factor rotate (the
    pairs past rotary_dim / 2 get frequency 0)."""
    if dim is not None and dim != cfg.head_dim:
        return _rotary_inv_freq(cfg, dim)
    inv_freq, attention_factor = _rotary_inv_freq(cfg, rotary_dim(cfg))
    pad = cfg.head_dim // 2 - inv_freq.shape[0]
    if pad and attention_factor != 1.0:       # the factor would scale the dims that do not rotate
        raise ValueError("unsupported: partial rotary with a rope attention factor (yarn)")
    return np.concatenate([inv_freq, np.zeros(pad, np.float32)]).astype(np.float32), attention_factor


def _rotary_inv_freq(cfg: ModelConfig, dim: int) -> tuple[np.ndarray, float]:
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type") or s.get("type") or "default"
    if kind == "default":
        return _base_inv_freq(cfg.rope_theta, dim), 1.0
    if kind == "linear":
        return (_base_inv_freq(cfg.rope_theta, dim) / np.float32(s["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(_base_inv_freq(cfg.rope_theta, dim), s), 1.0
    if kind == "yarn":
        return _yarn(cfg, dim, s)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def rope_cos_sin(cfg: ModelConfig, max_positions: int, dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32 [max_positions, dim/2] (dim as for rope_inv_freq); pair i is rotated by
    column i (neox pairs (x[i], x[i + dim/2]); MLA's interleaved pairs (x[2i], x[2i + 1]))."""
    inv_freq, attention_factor = rope_inv_freq(cfg, dim)
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos = (np.cos(angles) * np.float32(attention_factor)).astype(np.float32)
    sin = (np.sin(angles) * np.float32(attention_factor)).astype(np.float32)
    return cos, sin
