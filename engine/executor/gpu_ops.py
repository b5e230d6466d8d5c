"""The model Ops (engine/models/ops.py) on the GPU: CuPy device arrays, raw CUDA kernels, cuBLAS.

Every output is a view of a preallocated buffer: activations rotate through a ring of RING_SLOTS
buffers (a tensor is dead long before its slot comes round again), the residual stream has a buffer
of its own (updated in place by the residual adds), the logits have their own fp32 buffer, and the
attention split partials theirs. Nothing here allocates or synchronizes with the host, so a decode
step can be captured in a CUDA graph.

Decode fusion: where gemv.cu takes a linear layer (at most gemv_max_m rows), the RMSNorm before it,
the residual add after it and the SiLU·up after gate_up run inside the GEMV (norm_linear, add_linear,
norm_swiglu; the executor stores gate_up interleaved for that), and on decode-only steps q/k norm +
rope + KV write run inside the decode attention kernel (rope_attention): a Qwen3 layer is 5 kernels
(qkv GEMV, rope + attention, o_proj GEMV, gate_up GEMV + SiLU·up, down GEMV). Larger steps compose
them from the separate kernels, except the residual add of o_proj / down_proj, which the GEMM does in
its epilogue (cuBLAS beta = 1 into the residual buffer, or the CuTe GEMM's residual epilogue:
add_linear), and where the CuTe GEMM's plan splits that product in K, one kernel reduces its partials,
adds the residual and writes the RMSNorm of the next projection (add_linear_norm, rms_norm.cu
splitk_rms_norm_residual); the gate_up product on the CuTe GEMM computes SiLU·up in its epilogue
where its tile has that twin (norm_swiglu). With `pdl` on (CUDA-graph decode),
every kernel is a programmatic dependent launch (openinfer_kernels/raw_cuda/launch.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from engine.executor.attention_grid import (FUSED_ROPE_CTAS_PER_SM, MAX_DECODE_SPLITS, MAX_GROUP, MAX_HEAD_DIM,
                                            MAX_SPLITS, attention_splits, decode_attention_fits,
                                            decode_heads_per_cta, rope_heads_per_warp)
from engine.executor.gpu_lora_ops import GpuLoRAOps
from engine.executor.gpu_mla_ops import MLA_MAX_SPLITS, GpuMLAOps
from engine.executor.gpu_moe_ops import GpuMoEOps
from engine.executor.gpu_deltanet_ops import DeltaNetGpuOps
from engine.executor.gpu_dsv4_ops import GpuDSV4Ops
from engine.models.ops import AttentionSpec, ComposedOps
from openinfer_kernels.raw_cuda import kernel
from openinfer_kernels.raw_cuda.launch import launch
from memory.device_arena import Buffer, buffers_nbytes

RING_SLOTS = 10


def splitk_norm_threads(hidden: int) -> int:
    """Threads per row of rms_norm.cu's splitk_rms_norm_residual: one per 8 columns, whole warps."""
    return min(1024, -(-hidden // 256) * 32)


def op_range(fn):
    """The op in an NVTX range of its name when GpuOps.op_ranges is on (eager steps; a composed op's
    parts nest inside it), so an nsys timeline reads layer -> op -> kernels."""
    @functools.wraps(fn)
    def ranged(self, *args, **kwargs):
        if not self.op_ranges:
            return fn(self, *args, **kwargs)
        from engine.executor.gpu_graphs import nvtx_range
        with nvtx_range(fn.__name__):
            return fn(self, *args, **kwargs)
    return ranged


@dataclass
class GpuStepContext:
    """Device views of one step's ModelBatch arrays (static buffers, filled by the executor)."""
    num_tokens: int
    input_ids: object       # int32 [T]
    positions: object       # int32 [T]  (-1: padding)
    slot_mapping: object    # int32 [T]  (-1: padding)
    token_seq: object       # int32 [T]  row of block_tables each token reads
    block_tables: object    # int32 [B, max_blocks]
    sample_rows: object     # int32 [S]
    num_splits: int
    prefill: object = None  # gpu_prefill.PrefillStep: the CuTe kernel's sequences (eager steps only)
    batch: object = None    # the host ModelBatch (eager steps only; None in decode graphs)
    mla: object = None      # gpu_mla_ops: the step's expansion plan, built at its first MLA layer
    state_slots: object = None  # int32 [B]  state slot of each row (-1: padding; lines with state)
    cu_seqlens: object = None   # int32 [B+1] token offsets of the rows

    @property
    def decode_only(self) -> bool:
        """One query token per sequence (T == block-table rows; a decode graph's padded rows count as
        sequences of their own): no token of the step attends to another token's new key."""
        return self.num_tokens == self.block_tables.shape[0]


class GpuOps(GpuDSV4Ops, GpuLoRAOps, GpuMoEOps, GpuMLAOps, DeltaNetGpuOps, ComposedOps):
    op_ranges = False                       # NVTX range per op (op_range; eager steps)
    decode_defines: dict = {}               # paged_decode.cu build options (-D; benchmarks' A/B: STAGES, MIN_CTAS)
    decode_heads = 0                        # > 0: paged_decode.cu's heads per CTA (benchmarks' A/B)
    kv_layer_events = None                  # per-layer events of a restore in flight (the executor sets them)

    def __init__(self, arena, gemm, kv_cache, inv_freq, attention_factor: float, max_tokens: int,
                 max_width: int, hidden: int, vocab_size: int, logits_rows: int, num_heads: int, head_dim: int,
                 lm_head_ptr: int, stream, num_sms: int, fast_attention: bool = False):
        import cupy

        self.cp = cupy
        self.gemm = gemm
        self.kv_cache = kv_cache            # uint16 [L, 2, slots, Hkv, D]
        self.inv_freq = inv_freq            # float32 [D/2]
        self.attention_factor = float(attention_factor)
        self.stream = stream
        self.lm_head_ptr = lm_head_ptr
        self.max_tokens = max_tokens
        self.num_sms = num_sms
        b = arena.take_all("activations", self.buffers(max_tokens, max_width, hidden, vocab_size, logits_rows,
                                                       num_heads, head_dim, num_sms))
        self.ring = [b[f"ring{i}"] for i in range(RING_SLOTS)]
        self.ring_next = 0
        self.residual = b["residual"]
        self.pdl = False                    # programmatic dependent launches (set while capturing decode)
        self.layer_ranges = False           # NVTX range per decoder layer (eager steps; see layer_scope)
        self.gate_up_interleaved = False    # gate_up weights in gemv.cu's SiLU·up layout (set by the executor)
        self.logits = b["logits"]
        self.part_out, self.part_max, self.part_sum = b["attn_part_out"], b["attn_part_max"], b["attn_part_sum"]
        # paged_decode.cu's split tickets, one per (token, KV head); zero between launches.
        self.split_counters = b["attn_split_counters"]
        cupy.cuda.runtime.memsetAsync(self.split_counters.data.ptr, 0, self.split_counters.nbytes, stream.ptr)
        self.k_embed = kernel("embedding", "embedding_gather")
        self.k_rms = kernel("rms_norm", "rms_norm_residual")
        self.k_rms_splitk = kernel("rms_norm", "splitk_rms_norm_residual")
        self.k_rope = kernel("qk_norm_rope_cache", "qk_norm_rope_cache")
        self.k_silu = kernel("silu_mul", "silu_mul")
        self.k_bias = kernel("add_bias", "add_bias")
        self.k_add = kernel("add_bias", "residual_add")
        self.k_attn = kernel("paged_attention", "paged_attention_split")
        self.k_merge = kernel("paged_attention", "attention_merge")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.fast_attention = fast_attention   # paged_decode.cu instead of paged_attention_split
        self._decode_kernels: dict[tuple, object] = {}     # (group, entry, heads, defines) -> kernel
        self.fused_rope = True      # rope_attention in one kernel on decode steps (off: compose, for A/B)

    # ---- buffers -----------------------------------------------------------------------------
    @staticmethod
    def buffers(max_tokens: int, max_width: int, hidden: int, vocab_size: int, logits_rows: int, num_heads: int,
                head_dim: int, num_sms: int) -> list[Buffer]:
        """The activation ring, the residual stream, the logits and the attention split partials."""
        part_rows = (max_tokens + 2 * num_sms) * num_heads
        return ([Buffer(f"ring{i}", (max_tokens * max_width,), np.uint16) for i in range(RING_SLOTS)]
                + [Buffer("residual", (max_tokens * hidden,), np.uint16),
                   Buffer("logits", (logits_rows, vocab_size), np.float32),
                   Buffer("attn_part_out", (part_rows * head_dim,), np.float32),
                   Buffer("attn_part_max", (part_rows,), np.float32),
                   Buffer("attn_part_sum", (part_rows,), np.float32),
                   Buffer("attn_split_counters", (max_tokens * num_heads,), np.int32)])

    @classmethod
    def nbytes(cls, plan) -> int:
        """The activation buffers and, for the MoE / MLA lines, theirs (taken by take_sparse)."""
        return buffers_nbytes(cls.buffers(plan.max_tokens, plan.width, plan.hidden, plan.vocab, plan.logit_rows,
                                          plan.num_heads, plan.head_dim, plan.device.num_sms)) + cls.sparse_nbytes(plan)

    @classmethod
    def sparse_nbytes(cls, plan) -> int:
        return cls.moe_nbytes(plan) + cls.mla_nbytes(plan) + cls.lora_nbytes(plan)

    def take_sparse(self, arena, plan) -> None:
        """The MoE and MLA buffers of the plan's model line (gpu_moe_ops.py, gpu_mla_ops.py) and the
        LoRA slots (gpu_lora_ops.py)."""
        self.take_moe(arena, plan)
        self.take_mla(arena, plan)
        self.take_lora(arena, plan)

    def _out(self, rows: int, cols: int):
        if rows > self.max_tokens:
            raise ValueError(f"{rows} tokens exceed the {self.max_tokens} the activation buffers hold")
        buf = self.ring[self.ring_next]
        self.ring_next = (self.ring_next + 1) % RING_SLOTS
        return buf[: rows * cols].reshape(rows, cols)

    def reset(self) -> None:
        """Start each forward at slot 0 so a captured graph sees the same addresses on replay."""
        self.ring_next = 0

    def _launch(self, k, grid, block, args) -> None:
        launch(k, grid, block, args, self.stream, pdl=self.pdl)

    def _residual_out(self, rows: int, cols: int):
        if rows * cols > self.residual.shape[0]:
            raise ValueError(f"{rows} tokens exceed the {self.max_tokens} the residual buffer holds")
        return self.residual[: rows * cols].reshape(rows, cols)

    # ---- Ops ---------------------------------------------------------------------------------
    @op_range
    def embed(self, table, ctx: GpuStepContext):
        T, H = ctx.num_tokens, table.shape[1]
        out = self._out(T, H)
        self._launch(self.k_embed, (T,), (128,), (table, ctx.input_ids, out, np.int32(H)))
        return out

    @op_range
    def rms_norm(self, x, weight, eps: float, residual=None):
        T, H = x.shape
        out = self._out(T, H)
        r = self._out(T, H) if residual is not None else x
        self._launch(self.k_rms, (T,), (256,),
                     (x, residual if residual is not None else np.uint64(0), weight, out, r,
                      np.int32(H), np.float32(eps)))
        return out, r

    @op_range
    def linear(self, x, weight, bias=None):
        T = x.shape[0]
        N = weight.shape[0]
        if weight.data.ptr == self.lm_head_ptr:
            if T > self.logits.shape[0]:
                raise ValueError(f"{T} logit rows exceed the {self.logits.shape[0]} the logits buffer holds")
            out = self.logits[:T]
        else:
            out = self._out(T, N)
        self.gemm(x, weight, out, pdl=self.pdl)
        if bias is not None:
            total = T * N
            self._launch(self.k_bias, (min(1024, -(-total // 256)),), (256,),
                         (out, bias, np.int32(N), np.int64(total)))
        return out

    @op_range
    def qkv_rope_cache(self, qkv, spec: AttentionSpec, ctx: GpuStepContext, q_norm=None, k_norm=None):
        T = ctx.num_tokens
        Hq, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q = self._out(T, Hq * D).reshape(T, Hq, D)
        kc, vc = self.kv_cache[spec.layer, 0], self.kv_cache[spec.layer, 1]
        null = np.uint64(0)
        # a block per token shares one cos / sin table (qk_norm_rope_cache.cu; a warp serves
        # rope_heads_per_warp heads at once), split into head groups only while the tokens alone do not fill
        # the SMs twice
        warps = 8
        groups = 1 if T >= 2 * self.num_sms else -(-(Hq + 2 * Hkv) // (warps * rope_heads_per_warp(D)))
        self._launch(self.k_rope, (T, groups), (32 * warps,),
                     (qkv, q_norm if q_norm is not None else null, k_norm if k_norm is not None else null,
                      np.float32(spec.rms_eps), self.inv_freq, np.float32(self.attention_factor),
                      ctx.positions, ctx.slot_mapping, q, kc, vc, np.int32(Hq), np.int32(Hkv), np.int32(D)))
        return q

    def _decode_kernel(self, num_kv_heads: int, entry: str = "paged_decode_attention", heads: int = 0, **defines):
        """A paged_decode.cu entry for this model's group size (``heads`` query heads per CTA; 0: the
        whole group; defines: the entry's own build options, e.g. LORA_R), or None (switched off / no fit)."""
        group = self.num_heads // num_kv_heads
        if not self.fast_attention or not decode_attention_fits(group, self.head_dim):
            return None
        heads = heads or group
        if group % heads:
            raise ValueError(f"paged_decode.cu: {heads} heads per CTA do not divide the group of {group}")
        key = (group, entry, heads, tuple(sorted(defines.items())))
        if key not in self._decode_kernels:
            extra = {"HEADS": heads} if heads != group else {}
            self._decode_kernels[key] = kernel("paged_decode", entry, GQA=group, HEAD_DIM=self.head_dim, **extra,
                                               **self.decode_defines, **defines)
        return self._decode_kernels[key]

    def _heads_per_cta(self, num_tokens: int, num_kv_heads: int) -> int:
        """paged_decode.cu's query heads per CTA for a step of num_tokens query rows (decode_heads_per_cta,
        or the benchmarks' override)."""
        group = self.num_heads // num_kv_heads
        return self.decode_heads or decode_heads_per_cta(num_tokens, num_kv_heads, group, self.num_sms)

    def _decode_launch(self, spec: AttentionSpec, ctx: GpuStepContext, entry: str, **defines):
        """(kernel, grid) of a paged_decode.cu entry for this step, its head groups chosen once; None where
        the kernel does not serve the layer."""
        heads = self._heads_per_cta(ctx.num_tokens, spec.num_kv_heads)
        k = self._decode_kernel(spec.num_kv_heads, entry, heads, **defines)
        if k is None:
            return None
        groups = spec.num_heads // spec.num_kv_heads // heads
        return k, (ctx.num_tokens, ctx.num_splits, spec.num_kv_heads * groups)

    def _rope_decode_kernel(self, spec: AttentionSpec, ctx: GpuStepContext, entry="rope_paged_decode_attention",
                            **defines):
        """paged_decode.cu's fused q/k norm + rope + KV write + attention entry and its grid, when the step is decode
        only, its grid is at most FUSED_ROPE_CTAS_PER_SM CTAs per SM and the decode kernel serves this layer; else None
        (the composition runs; both give the same bits)."""
        if (not self.fused_rope or not ctx.decode_only or spec.head_dim != self.head_dim
                or spec.num_heads != self.num_heads
                or ctx.num_splits * spec.num_kv_heads * ctx.num_tokens > FUSED_ROPE_CTAS_PER_SM * self.num_sms):
            return None
        return self._decode_launch(spec, ctx, entry, **defines)

    def splits(self, num_tokens: int, num_kv_heads: int, max_context: int) -> int:
        """The step's KV split count for the attention kernel in use."""
        group = self.num_heads // num_kv_heads
        fast = self.fast_attention and decode_attention_fits(group, self.head_dim)
        mla = getattr(self, "mla", None) is not None          # mla_decode.cu sizes its own head groups
        if mla and num_tokens == 1:
            # A batch-1 MLA step takes up to 32 splits (mla_decode_shape then gives 2 heads a CTA):
            # DeepSeek-V2-Lite in a graph, 1k / 4k keys, 21.7 / 53.2 -> 19.7 / 37.5 µs a layer; at 8 tokens
            # 16 stays better (49.6 against 61.3 at 1k keys) (H200, bench/moe_micro.py, 2026-12-04 19:45 UTC).
            return attention_splits(1, num_kv_heads, max_context, MLA_MAX_SPLITS, self.num_sms)
        groups = group // self._heads_per_cta(num_tokens, num_kv_heads) if fast and not mla else 1
        return attention_splits(num_tokens, num_kv_heads, max_context, MAX_DECODE_SPLITS if fast else MAX_SPLITS,
                                self.num_sms, groups)

    def _check_attention(self, spec: AttentionSpec, ctx: GpuStepContext) -> None:
        Hq, Hkv, D, S = spec.num_heads, spec.num_kv_heads, spec.head_dim, ctx.num_splits
        if Hq // Hkv > MAX_GROUP or D > MAX_HEAD_DIM or D % 2 or Hq % Hkv:
            raise ValueError(f"attention kernel supports an even D <= {MAX_HEAD_DIM}, "
                             f"Hq/Hkv <= {MAX_GROUP}; got Hq={Hq}, Hkv={Hkv}, D={D}")
        if ctx.num_tokens * Hq * S > self.part_max.shape[0] or S > MAX_DECODE_SPLITS:
            raise ValueError(f"attention partials: {ctx.num_tokens} tokens x {S} splits exceed the buffer")

    def _decode_args(self, spec: AttentionSpec, ctx: GpuStepContext, out) -> tuple:
        """paged_decode.cu's arguments from the KV cache on (the same for both entries)."""
        kc, vc = self.kv_cache[spec.layer, 0], self.kv_cache[spec.layer, 1]
        return (kc, vc, ctx.block_tables, np.int32(ctx.block_tables.shape[1]), ctx.token_seq, ctx.positions,
                self.part_out, self.part_max, self.part_sum, out, self.split_counters,
                np.int32(spec.num_kv_heads), np.float32(spec.scale))

    @op_range
    def rope_attention(self, qkv, spec: AttentionSpec, ctx: GpuStepContext, q_norm=None, k_norm=None):
        """Decode steps: one paged_decode.cu launch does q/k norm, rope, the KV write and attention.
        Other steps compose qkv_rope_cache and attention (a later query token of a sequence needs the
        earlier tokens' keys in the cache before it attends)."""
        fused = self._rope_decode_kernel(spec, ctx)
        if fused is None:
            return super().rope_attention(qkv, spec, ctx, q_norm=q_norm, k_norm=k_norm)
        return self._rope_decode(fused, (qkv,), spec, ctx, q_norm, k_norm)

    def _rope_decode(self, fused, rows: tuple, spec: AttentionSpec, ctx: GpuStepContext, q_norm, k_norm):
        """Launch a fused rope + decode attention entry (kernel, grid): `rows` its qkv-row arguments, then
        the arguments every entry shares. Returns o[T, Hq·D]."""
        self._kv_layer_ready(spec.layer)
        self._check_attention(spec, ctx)
        null = np.uint64(0)
        out = self._out(ctx.num_tokens, spec.num_heads * spec.head_dim)
        self._launch(*fused, (128,),
                     rows + (q_norm if q_norm is not None else null, k_norm if k_norm is not None else null,
                             np.float32(spec.rms_eps), self.inv_freq, np.float32(self.attention_factor),
                             ctx.slot_mapping) + self._decode_args(spec, ctx, out))
        return out

    @op_range
    def attention(self, q, spec: AttentionSpec, ctx: GpuStepContext, out=None):
        """o[T, Hq·D] into `out` (default: the next activation buffer; piecewise graphs pass the rows
        their next segment reads)."""
        self._kv_layer_ready(spec.layer)
        if ctx.prefill is not None and ctx.prefill.serves(spec):     # long sequences: CuTe (gpu_prefill.py)
            return ctx.prefill.attention(self, q, spec, ctx, out)
        if out is None:
            out = self._out(ctx.num_tokens, spec.num_heads * spec.head_dim)
        self.paged_attention(q, spec, ctx, out)
        return out

    def _kv_layer_ready(self, layer: int) -> None:
        """A host-tier restore copying layer by layer (GpuExecutor._restore_by_layer): wait for this layer's."""
        if self.kv_layer_events is not None:
            self.stream.wait_event(self.kv_layer_events[layer])

    def paged_attention(self, q, spec: AttentionSpec, ctx: GpuStepContext, out) -> None:
        """out[T, Hq·D] = attention of ctx's T query rows over the paged cache (paged_decode.cu where it
        fits, else paged_attention_split + attention_merge)."""
        T = ctx.num_tokens
        Hq, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        S = ctx.num_splits
        self._check_attention(spec, ctx)
        kc, vc = self.kv_cache[spec.layer, 0], self.kv_cache[spec.layer, 1]
        fast = self._decode_launch(spec, ctx, "paged_decode_attention") if D == self.head_dim else None
        if fast is not None:
            self._launch(*fast, (128,), (q,) + self._decode_args(spec, ctx, out))
            return
        self._launch(self.k_attn, (S, Hkv, T), (128,),
                     (q, kc, vc, ctx.block_tables, np.int32(ctx.block_tables.shape[1]), ctx.token_seq,
                      ctx.positions, self.part_out, self.part_max, self.part_sum,
                      np.int32(Hq), np.int32(Hkv), np.int32(D), np.float32(spec.scale)))
        self._launch(self.k_merge, (T * Hq,), (128,),
                     (self.part_out, self.part_max, self.part_sum, out, np.int32(S), np.int32(D)))

    @op_range
    def silu_mul(self, gate_up):
        T, two_i = gate_up.shape
        inter = two_i // 2
        out = self._out(T, inter)
        total = T * inter // 8
        self._launch(self.k_silu, (max(1, min(4096, -(-total // 256))),), (256,),
                     (gate_up, out, np.int32(inter), np.int64(total), np.int32(self.gate_up_interleaved)))
        return out

    @op_range
    def gather_rows(self, x, rows):
        R, H = rows.shape[0], x.shape[1]
        out = self._out(R, H)
        if R:
            self._launch(self.k_embed, (R,), (128,), (x, rows, out, np.int32(H)))
        return out

    @op_range
    def add(self, x, residual):
        T, H = x.shape
        out = self._residual_out(T, H)
        total = T * H // 8
        self._launch(self.k_add, (max(1, min(4096, -(-total // 256))),), (256,),
                     (x, residual, out, np.int64(total)))
        return out

    # ---- fused decode ops (gemv.cu), composed from the above where the GEMV does not serve ----
    @op_range
    def norm_linear(self, x, norm_weight, eps, weight, bias=None, normed=None, lora=None):
        """gemv.cu's RMSNorm prologue + product (a LoRA delta after it, its shrink norming x again);
        else the composition."""
        if bias is None and self.lora_fused(lora, x.shape[0]):
            return self.lora_norm_linear(x, norm_weight, eps, lora, normed)
        if normed is not None or bias is not None or not self.gemm.gemv_serves(x, weight):
            return super().norm_linear(x, norm_weight, eps, weight, bias, normed=normed, lora=lora)
        out = self._out(x.shape[0], weight.shape[0])
        self.gemm.gemv(x, weight, out, "norm", norm_w=norm_weight, eps=eps, pdl=self.pdl)
        return self.lora_add(out, x, lora, norm=(norm_weight, eps)) if self.lora_on(lora) else out

    @op_range
    def norm_swiglu(self, x, norm_weight, eps, gate_up_weight, normed=None, lora=None):
        """gemv.cu's RMSNorm + product + SiLU·up in one kernel; else the CuTe GEMM's SiLU·up twin
        after the norm (one kernel fewer than product + silu_mul); else (and with a LoRA adapter in
        the step: the product, then lora_expand.cu's SiLU·up with the delta added first) the composition."""
        rows = x.shape[0]
        if self.lora_fused(lora, rows):
            return self.lora_norm_swiglu(x, norm_weight, eps, lora, normed)
        if self.lora_on(lora):
            return self.lora_unfused_swiglu(x, norm_weight, eps, gate_up_weight, normed, lora)
        if self.gate_up_interleaved and self.gemm.gemv_serves(x if normed is None else normed, gate_up_weight):
            out = self._out(rows, gate_up_weight.shape[0] // 2)
            if normed is None:
                self.gemm.gemv(x, gate_up_weight, out, "norm_silu", norm_w=norm_weight, eps=eps, pdl=self.pdl)
            else:               # normed already (the MoE lines' shared experts): SiLU·up without the norm
                self.gemm.gemv(normed, gate_up_weight, out, "silu", pdl=self.pdl)
            return out
        if not (self.gate_up_interleaved and self.gemm.cute_fuses_swiglu(rows, gate_up_weight)):
            return super().norm_swiglu(x, norm_weight, eps, gate_up_weight, normed=normed)
        if normed is None:
            normed, _ = self.rms_norm(x, norm_weight, eps)
        out = self._out(rows, gate_up_weight.shape[0] // 2)
        self.gemm.cute_swiglu(normed, gate_up_weight, out)
        return out

    @op_range
    def add_linear(self, x, weight, residual, bias=None, lora=None):
        """The residual add in the product (gemv.cu's epilogue, cuBLAS beta = 1); a LoRA delta is added
        into the sum after it."""
        if bias is not None:
            return super().add_linear(x, weight, residual, bias, lora=lora)
        out = self._residual_out(x.shape[0], weight.shape[0])
        if self.gemm.gemv_serves(x, weight):
            self.gemm.gemv(x, weight, out, "res", res_in=residual, pdl=self.pdl)
            return self.lora_add(out, x, lora)
        if residual.data.ptr != out.data.ptr:  # the first layer's residual is the embedding output
            self.cp.cuda.runtime.memcpyAsync(out.data.ptr, residual.data.ptr, out.nbytes,
                                             self.cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
        self.gemm(x, weight, out, accumulate=True)  # cuBLAS beta = 1: the add in the product's epilogue
        return self.lora_add(out, x, lora)

    @op_range
    def add_linear_norm(self, x, weight, residual, norm_weight, eps, bias=None, lora=None):
        """Where the CuTe GEMM's plan splits the product in K: the split GEMM, then one kernel that
        reduces its partials, adds the residual and applies the RMSNorm after it
        (rms_norm.cu splitk_rms_norm_residual), a LoRA delta added into the first partial before it;
        elsewhere add_linear, the norm left to the next op."""
        if bias is None and self.lora_fused(lora, x.shape[0]):
            return self.lora_add_linear_norm(x, lora, residual, norm_weight, eps)
        fusable = bias is None and not self.gemm.gemv_serves(x, weight)
        partials = self.gemm.cute_partials(x, weight, residual) if fusable else None
        if partials is None:
            return self.add_linear(x, weight, residual, bias, lora=lora), None
        T, N = x.shape[0], weight.shape[0]
        out, normed = self._residual_out(T, N), self._out(T, N)
        splits, _, _ = partials.shape
        self.reduce_partials(partials)
        if self.lora_on(lora):
            if tuple(partials.shape[1:]) != (T, N) or tuple(partials.strides[1:]) != (N, 1):
                raise ValueError(f"split-K partials {partials.shape} / {partials.strides}: not [S, {T}, {N}] rows")
            self.lora_add(None, x, lora, into=partials.ptr)
        self._launch(self.k_rms_splitk, (T,), (splitk_norm_threads(N),),
                     (np.uint64(partials.ptr), np.int32(splits), np.int64(T * N), residual, norm_weight, normed, out,
                      np.int32(N), np.float32(eps)))
        return out, normed

    def reduce_partials(self, partials) -> None:
        """Where a product's split-K partials [S, T, N] (float32) are complete before their reduction: a
        tensor-parallel rank sums them over the ranks here (engine/parallel); nothing on one GPU."""

    def layer_scope(self, layer: int):
        """An NVTX range "layer i" when layer_ranges is on (eager steps: a captured graph replays
        kernels, not host ranges; profile graphs with nsys --cuda-graph-trace=node)."""
        if not self.layer_ranges:
            return super().layer_scope(layer)
        from engine.executor.gpu_graphs import nvtx_range
        return nvtx_range(f"layer {layer}")
