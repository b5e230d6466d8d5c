"""The Ops of engine/models/ops.py in numpy (float32), over the paged KV pool of memory/kv_pool.py,
kv[layer, K/V, slots, Hkv, D], and the op families the served line uses as parts (cpu_*_ops.py). This is the
reference the GPU kernels are checked against."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.batch import ModelBatch
from engine.executor.cpu_attention import PagedAttention
from engine.executor.cpu_deltanet_ops import NumpyDeltaNetOps
from engine.executor.cpu_dsv4_attention import NumpyDSV4Ops
from engine.executor.cpu_dsv4_ops import xp_of
from engine.executor.cpu_lora_ops import NumpyLoRAOps
from engine.executor.cpu_mla_ops import NumpyMLAOps
from engine.executor.cpu_moe_ops import NumpyMoEOps
from engine.executor.cpu_quant_ops import w8a8_linear
from engine.models.ops import AttentionSpec, ComposedOps
from engine.models.quant_linear import Fp8Linear
from memory.kv_format import KVFormat
from memory.kv_pool import BLOCK_SIZE, block_view


@dataclass
class CpuStepContext:
    batch: ModelBatch
    cos: np.ndarray              # float32 [T, D/2] at the step's positions
    sin: np.ndarray


def rms(x, weight, eps: float):
    """RMSNorm of x's rows (numpy or CuPy arrays: an EAGLE-3 head's draft runs on either)."""
    xp = xp_of(x)
    var = xp.mean(xp.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x * (np.float32(1.0) / xp.sqrt(var + np.float32(eps)))) * weight


def rope(x, cos, sin):
    """Neox rotary on x[T, heads, D]: pairs (x[i], x[i + D/2]) rotated by the position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return xp_of(x).concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class NumpyOps(ComposedOps):
    """The dense Ops in numpy and the served line's op families as parts (None where it uses none)."""

    def __init__(self, kv: np.ndarray, families: frozenset[str] = frozenset(), state: dict | None = None,
                 lora: NumpyLoRAOps | None = None, kv_format: KVFormat = KVFormat()):
        """kv: [layers, planes, slots, heads, dim], float32 or e4m3 as kv_format stores it (memory/kv_format.py);
        families: the line's op_families; state: its state slots (memory/state_slots.py host_state); lora: the
        executor's adapter slots."""
        self.kv, self.kv_format = kv, kv_format
        self.moe = self._moe_part() if "moe" in families else None
        self.mla = NumpyMLAOps(kv, self.rms_norm, kv_format) if "mla" in families else None
        self.deltanet = NumpyDeltaNetOps(state) if "deltanet" in families else None
        self.dsv4 = NumpyDSV4Ops(kv, state) if "dsv4" in families else None
        self.lora = lora
        self.paged = PagedAttention()

    @property
    def rolls_back_state(self) -> bool:
        """A verify step's rejected drafts leave the state slots as before: the DeltaNet part holds drafts
        out of its state (cpu_deltanet_ops.py); DeepSeek-V4's compressor rings take them (unless the model made
        room for them: DeepseekV4ForCausalLM.make_room_for_drafts)."""
        return self.dsv4 is None

    def _moe_part(self) -> NumpyMoEOps:
        """The MoE part (a tensor-parallel rank's ops build their own, engine/parallel)."""
        return NumpyMoEOps(self.silu_mul)

    def use_lora(self, token_slots: np.ndarray | None) -> None:
        """The step's token -> LoRA slot map (None: no adapter in the step)."""
        if self.lora is not None:
            self.lora.use(token_slots)
        elif token_slots is not None:
            raise ValueError("the step's LoRA slots are outside the executor's (max_loras)")

    def embed(self, table: np.ndarray, ctx: CpuStepContext) -> np.ndarray:
        return table[ctx.batch.input_ids].astype(np.float32)

    def rms_norm(self, x, weight, eps, residual=None):
        r = x if residual is None else x + residual
        return rms(r, weight, eps).astype(np.float32), r

    def linear(self, x, weight, bias=None):
        y = w8a8_linear(x, weight) if isinstance(weight, Fp8Linear) else x @ weight.T
        return y if bias is None else y + bias

    def qkv_rope_cache(self, qkv, spec: AttentionSpec, ctx: CpuStepContext, q_norm=None, k_norm=None):
        T, D = qkv.shape[0], spec.head_dim
        nq, nkv = spec.num_heads * D, spec.num_kv_heads * D
        q = qkv[:, :nq].reshape(T, spec.num_heads, D)
        k = qkv[:, nq:nq + nkv].reshape(T, spec.num_kv_heads, D)
        v = qkv[:, nq + nkv:nq + 2 * nkv].reshape(T, spec.num_kv_heads, D)
        if q_norm is not None:
            q = rms(q, q_norm, spec.rms_eps)
        if k_norm is not None:
            k = rms(k, k_norm, spec.rms_eps)
        q, k = rope(q, ctx.cos, ctx.sin), rope(k, ctx.cos, ctx.sin)
        slots = ctx.batch.slot_mapping
        self.kv[spec.layer, 0, slots] = self.kv_format.store(k, spec.layer, 0)
        self.kv[spec.layer, 1, slots] = self.kv_format.store(v, spec.layer, 1)
        return q.astype(np.float32)

    def attention(self, q, spec: AttentionSpec, ctx: CpuStepContext):
        b = ctx.batch
        out = np.empty(q.shape, dtype=np.float32)
        k_plane = block_view(self.kv[spec.layer, 0])
        v_plane = block_view(self.kv[spec.layer, 1])
        for i in range(len(b.seqs)):
            q0, q1 = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1])
            L = int(b.context_lens[i])
            blocks = b.block_tables[i, : -(-L // BLOCK_SIZE)]
            out[q0:q1] = self.paged.attend(q[q0:q1], k_plane, v_plane, blocks, L, b.positions[q0:q1], spec.scale,
                                           self.kv_format.plane_scales(spec.layer))
        return out.reshape(q.shape[0], -1)

    def silu_mul(self, gate_up):
        half = gate_up.shape[-1] // 2
        g, u = gate_up[:, :half], gate_up[:, half:]
        return (g * (np.float32(0.5) * (np.float32(1.0) + np.tanh(g * np.float32(0.5))))) * u

    def gather_rows(self, x, rows):
        return x[np.asarray(rows, dtype=np.int64)]

    def add(self, x, residual):
        return x + residual
