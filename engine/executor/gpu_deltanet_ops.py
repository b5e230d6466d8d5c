"""The hybrid lines' op family (Gated DeltaNet + gated attention: ops.deltanet, models/ops.py DeltaNetOps) on the
GPU, a part GpuOps builds for a line with per-sequence state, over the executor's GpuShared. Raw CUDA kernels,
one launch each:
  causal_conv1d      causal_conv1d.cu          conv over the window + SiLU, the window's update
  gated_delta_rule   gated_delta_rule.cu       sequences of one own row, or with drafts: the one-step recurrence
                                               the others: the chunk-parallel form, CHUNK tokens per chunk
  gated_rms_norm     gated_rms_norm.cu         rmsnorm · w · silu(z) per value head
  sigmoid_gate       sigmoid_gate.cu           the gated attention's o · sigmoid(gate)
The state (memory/state_slots.py) comes from the executor: state["conv"] bf16 (uint16) [L, slots, K - 1,
conv_dim] and state["recurrent"] float32 [L, slots, Hv, Dk, Dv]; the step's slot ids, sequence
offsets and positions are the context's static inputs (gpu_inputs.py), so decode graphs replay these
launches as they are. Every kernel skips rows whose slot is -1 (a graph's padding rows).
Speculative decoding: with the model's held-draft arrays (state["held_conv"] [L, slots, k, conv_dim],
state["held_delta"] [L, slots, 2, k, conv_dim + 2 Hv], models/qwen3_5.py make_room_for_drafts) a verify step's
draft rows are held out of the state and applied at the sequence's next step (ctx.held, gpu_held_drafts.py).
"""
from __future__ import annotations

import numpy as np

from openinfer_kernels.raw_cuda import kernel

CHUNK = 64                  # gated_delta_rule.cu CHUNK (= cpu_deltanet_ops.CHUNK)
VB = 32                     # value columns per CTA of both delta-rule entries
CHUNK_THREADS = 256
DECODE_THREADS = 128
MAX_KEY_DIM = 256


def chunked_smem_bytes(dk: int) -> int:
    """Dynamic shared memory of gated_delta_rule_chunked (its ChunkSmem): q and k tiles (bf16, rows of
    dk + 2), five per-token float arrays, L and A [CHUNK][CHUNK + 1], R [CHUNK][VB], S [dk][VB]."""
    return 2 * CHUNK * (dk + 2) * 2 + 4 * (5 * CHUNK + 2 * CHUNK * (CHUNK + 1) + CHUNK * VB + dk * VB)


def check_deltanet_shapes(spec) -> None:
    """The kernels' shape limits, refused at start."""
    if (spec.k_dim % 2 or spec.k_dim > MAX_KEY_DIM or spec.value_size % 2 or spec.num_v_heads % spec.num_k_heads
            or spec.conv_kernel > 8):
        raise ValueError(f"Gated DeltaNet kernels need an even key dim <= {MAX_KEY_DIM} (got {spec.k_dim}), an even "
                         f"value size (got {spec.value_size}), value heads a multiple of key heads (got "
                         f"{spec.num_v_heads}/{spec.num_k_heads}) and a conv width <= 8 (got {spec.conv_kernel})")


class GpuDeltaNetOps:
    """ops.deltanet on the GPU; state: the executor's state slots (memory/state_slots.py)."""

    def __init__(self, shared, state: dict | None):
        self.shared, self.state = shared, state
        self._kernels: dict[tuple, object] = {}
        self.holds_drafts = state is not None and "held_delta" in state

    def _held(self, name: str, layer: int, ctx) -> tuple:
        """(codes, this layer's held array, its rows per buffer) for the kernels; nulls without drafts."""
        if not self.holds_drafts:
            return np.uint64(0), np.uint64(0), np.int32(0)
        a = self.state[name][layer]
        return ctx.held, a, np.int32(a.shape[-2])

    def _entries(self, ctx) -> tuple[bool, bool]:
        """(recurrent, chunked): the delta-rule entries a step launches, each skipping the other's sequences
        (gated_delta_rule.cu takes_recurrent); a sequence past position 0 may apply held drafts (recurrent)."""
        if ctx.decode_only:
            return True, False
        b = ctx.batch
        if b is None:                               # a captured step: both, the device picks per sequence
            return True, True
        drafts = np.array([s.num_drafts for s in b.seqs])
        own = np.diff(b.cu_seqlens) - drafts
        resumed = self.holds_drafts and any(s.start_pos > 0 for s in b.seqs)
        return bool(np.any((own <= 1) | (drafts > 0))) or resumed, bool(np.any((own > 1) & (drafts == 0)))

    def _kernel(self, name: str, entry: str, **defines: int):
        """A compiled entry, cached per compile-time constants; the chunked entry may use more than
        48 KB of dynamic shared memory."""
        key = (name, entry, tuple(sorted(defines.items())))
        if key not in self._kernels:
            k = kernel(name, entry, **defines)
            if entry == "gated_delta_rule_chunked":
                k.max_dynamic_shared_size_bytes = chunked_smem_bytes(defines["DK"])
            self._kernels[key] = k
        return self._kernels[key]

    def causal_conv1d(self, proj, weight, spec, ctx):
        T, C, sh = ctx.num_tokens, spec.conv_dim, self.shared
        out = sh.out(T, C)
        k = self._kernel("causal_conv1d", "causal_conv1d", CONV_K=spec.conv_kernel)
        sh.launch(k, (-(-C // 256), ctx.state_slots.shape[0]), (256,),
                  (proj, np.int32(proj.shape[1]), weight, self.state["conv"][spec.layer], out, ctx.cu_seqlens,
                   ctx.positions, ctx.state_slots, np.int32(C)) + self._held("held_conv", spec.layer, ctx))
        return out

    def gated_delta_rule(self, x, proj, a_log, dt_bias, spec, ctx):
        T, Hv, Dv, sh = ctx.num_tokens, spec.num_v_heads, spec.v_dim, self.shared
        out = sh.out(T, Hv * Dv)
        head = (x, proj, np.int32(proj.shape[1]), np.int32(spec.b_offset), np.int32(spec.a_offset), a_log, dt_bias,
                self.state["recurrent"][spec.layer], out)
        tail = (np.int32(spec.num_k_heads), np.int32(Hv), np.int32(Dv), np.float32(spec.k_dim ** -0.5))
        grid = (-(-Dv // VB), Hv, ctx.state_slots.shape[0])
        seqs = (ctx.cu_seqlens, ctx.positions, ctx.state_slots)
        codes, held, held_k = self._held("held_delta", spec.layer, ctx)
        recurrent, chunked = self._entries(ctx)
        if recurrent:
            k = self._kernel("gated_delta_rule", "gated_delta_rule_recurrent", DK=spec.k_dim)
            sh.launch(k, grid, (DECODE_THREADS,), head + seqs + tail + (codes, held, held_k))
        if chunked:
            k = self._kernel("gated_delta_rule", "gated_delta_rule_chunked", DK=spec.k_dim)
            sh.launch(k, grid, (CHUNK_THREADS,), head + seqs + tail + (codes,),
                      shared_mem=chunked_smem_bytes(spec.k_dim))
        return out

    def gated_rms_norm(self, x, proj, weight, spec):
        T, Hv, Dv, sh = x.shape[0], spec.num_v_heads, spec.v_dim, self.shared
        out = sh.out(T, Hv * Dv)
        rows = T * Hv
        k = self._kernel("gated_rms_norm", "gated_rms_norm")
        sh.launch(k, (-(-rows // 4),), (128,),
                  (x, np.uint64(proj.data.ptr + 2 * spec.z_offset), np.int32(proj.shape[1]), weight, out,
                   np.int32(rows), np.int32(Hv), np.int32(Dv), np.float32(spec.rms_eps)))
        return out

    def sigmoid_gate(self, x, gate):
        T, n = x.shape
        if n % 8:
            raise ValueError(f"sigmoid_gate.cu takes rows of a multiple of 8 values, got {n}")
        out = self.shared.out(T, n)
        total = T * n // 8
        k = self._kernel("sigmoid_gate", "sigmoid_gate")
        self.shared.launch(k, (max(1, min(4096, -(-total // 256))),), (256,), (x, gate, out, np.int64(total)))
        return out
