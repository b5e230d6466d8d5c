"""The multi-head latent attention op family in numpy (float32; ops.mla, models/ops.py MLAOps) over the one-plane
paged pool of an MLA model line, kv[layer, 0, slots, 0, kv_lora_rank + rope_dim] (RMSNorm'd latent, then the rotated rope key).

attention takes the absorbed form for a sequence with one new token (decode: W_UK folded into
the query, attention over the latent, W_UV after) and expands K and V from the latent otherwise
(prefill, transformers' form); both are exact in float32 and gated against transformers.
"""
from __future__ import annotations

import numpy as np

from engine.models.ops import MLASpec
from memory.kv_format import KVFormat
from memory.kv_pool import BLOCK_SIZE, block_view


def rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary on x[T, heads, D] with interleaved pairs (x[2i], x[2i+1]) (transformers'
    DeepseekV2 apply_rotary_emb: complex multiply); cos, sin [T, D/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x, dtype=np.float32)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def split_kv_b(kv_b: np.ndarray, spec: MLASpec) -> tuple[np.ndarray, np.ndarray]:
    """(W_UK [H, nope, R], W_UV [H, v, R]): each head's rows of kv_b_proj [H·(nope + v), R]."""
    w = np.ascontiguousarray(kv_b).reshape(spec.num_heads, spec.nope_dim + spec.v_dim, spec.kv_lora_rank)
    return w[:, :spec.nope_dim], w[:, spec.nope_dim:]


def _softmax_masked(scores: np.ndarray, masked: np.ndarray) -> np.ndarray:
    scores = np.where(masked, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    return p / p.sum(axis=-1, keepdims=True)


def mla_absorbed(q_nope, q_pe, c, k_pe, w_uk, w_uv, masked, scale) -> np.ndarray:
    """o[n, H, v] = W_UV · softmax((W_UKᵀ q_nope)·c + q_pe·k_pe) c: attention over the latent."""
    q_lat = np.einsum("nhd,hdr->nhr", q_nope, w_uk)                         # [n, H, R]
    scores = (q_lat @ c.T + q_pe @ k_pe.T) * np.float32(scale)              # [n, H, L]
    o_lat = _softmax_masked(scores, masked[:, None, :]) @ c                 # [n, H, R]
    return np.einsum("nhr,hvr->nhv", o_lat, w_uv)


def mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, masked, scale) -> np.ndarray:
    """The same attention with k_nope = W_UK·c and v = W_UV·c built per head (transformers' form)."""
    k_nope = np.einsum("lr,hdr->hld", c, w_uk)                              # [H, L, nope]
    v = np.einsum("lr,hvr->hlv", c, w_uv)                                   # [H, L, v]
    scores = (q_nope.transpose(1, 0, 2) @ k_nope.transpose(0, 2, 1)
              + (q_pe @ k_pe.T).transpose(1, 0, 2)) * np.float32(scale)    # [H, n, L]
    o = _softmax_masked(scores, masked[None]) @ v                          # [H, n, v]
    return o.transpose(1, 0, 2)


class NumpyMLAOps:
    """ops.mla of the numpy executor over the paged pool kv; norm: the dense ops' rms_norm."""

    def __init__(self, kv: np.ndarray, norm, kv_format: KVFormat = KVFormat()):
        self.kv, self.norm, self.kv_format = kv, norm, kv_format

    def latent_cache(self, y, spec: MLASpec, ctx, kv_norm, q_norm=None):
        qc, R = spec.q_cols, spec.kv_lora_rank
        c, _ = self.norm(y[:, qc:qc + R], kv_norm, spec.rms_eps)
        k_pe = rope_interleaved(y[:, None, qc + R:qc + R + spec.rope_dim], ctx.cos, ctx.sin)[:, 0]
        slots = ctx.batch.slot_mapping
        self.kv[spec.layer, 0, slots, 0, :R] = self.kv_format.store(c, spec.layer, 0)
        self.kv[spec.layer, 0, slots, 0, R:] = self.kv_format.store(k_pe, spec.layer, 0)
        q = np.ascontiguousarray(y[:, :qc], dtype=np.float32)
        return q if q_norm is None else self.norm(q, q_norm, spec.rms_eps)[0]

    def latent_attention(self, y, kv_b, spec: MLASpec, ctx, kv_norm):
        return self.attention(self.latent_cache(y, spec, ctx, kv_norm), kv_b, spec, ctx)

    def attention(self, q, kv_b, spec: MLASpec, ctx):
        b = ctx.batch
        T, H, R = q.shape[0], spec.num_heads, spec.kv_lora_rank
        q = q.reshape(T, H, spec.qk_dim)
        q_nope, q_pe = q[..., :spec.nope_dim], rope_interleaved(q[..., spec.nope_dim:], ctx.cos, ctx.sin)
        w_uk, w_uv = split_kv_b(kv_b, spec)
        cache = block_view(self.kv[spec.layer, 0])
        out = np.empty((T, H, spec.v_dim), dtype=np.float32)
        for i in range(len(b.seqs)):
            q0, q1, L = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1]), int(b.context_lens[i])
            rows = cache[b.block_tables[i, : -(-L // BLOCK_SIZE)]].reshape(-1, spec.cache_dim)[:L]
            rows = self.kv_format.load(rows, spec.layer, 0)
            masked = np.arange(L)[None, :] > b.positions[q0:q1][:, None]    # [n, L] causal
            form = mla_absorbed if q1 - q0 == 1 else mla_expanded
            out[q0:q1] = form(q_nope[q0:q1], q_pe[q0:q1], rows[:, :R], rows[:, R:], w_uk, w_uv, masked, spec.scale)
        return out.reshape(T, H * spec.v_dim)
