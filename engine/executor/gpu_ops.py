"""The model Ops (engine/models/ops.py) on the GPU: CuPy device arrays, raw CUDA kernels, cuBLAS.

Every output is a view of a preallocated buffer: the activation ring and the residual stream's buffer
(GpuShared, gpu_shared.py), the logits' own fp32 buffer and the attention split partials'. Nothing here
allocates or synchronizes with the host, so a decode step can be captured in a CUDA graph. The op families
a line uses beyond these (MoE, MLA, LoRA, Gated DeltaNet, DeepSeek-V4) are parts built from the plan
(gpu_*_ops.py): `ops.moe`, `ops.mla`, ... (None where the line uses none).

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

import contextlib
import functools

import numpy as np

from engine.executor import gpu_graphs
from engine.executor.attention_grid import (FUSED_ROPE_CTAS_PER_SM, MAX_DECODE_SPLITS, MAX_GROUP, MAX_HEAD_DIM,
                                            MAX_SPLITS, attention_splits, decode_attention_fits,
                                            decode_heads_per_cta, rope_heads_per_warp)
from engine.executor.gpu_deltanet_ops import GpuDeltaNetOps
from engine.executor.gpu_dsv4_ops import GpuDSV4Ops
from engine.executor.gpu_inputs import GpuStepContext
from engine.executor.gpu_lora_ops import GpuLoRAOps
from engine.executor.gpu_mla_ops import MLA_MAX_SPLITS, GpuMLAOps
from engine.executor.gpu_moe_ops import GpuMoEOps
from engine.executor.gpu_shared import activation_buffers, splitk_norm_threads
from engine.executor.options import parse_decode_kernels
from engine.models.ops import AttentionSpec, ComposedOps
from openinfer_kernels.raw_cuda import kernel
from memory.device_arena import Buffer, buffers_nbytes


def op_range(fn):
    """The op in an NVTX range of its name when GpuOps.op_ranges is on (eager steps; a composed op's
    parts nest inside it), so an nsys timeline reads layer -> op -> kernels."""
    @functools.wraps(fn)
    def ranged(self, *args, **kwargs):
        if not self.op_ranges:
            return fn(self, *args, **kwargs)
        with gpu_graphs.nvtx_range(fn.__name__):
            return fn(self, *args, **kwargs)
    return ranged


class GpuOps(ComposedOps):
    """The dense Ops on the GPU, and the op families the plan's line uses as parts (moe, mla, lora, deltanet,
    dsv4: None where it uses none), each built from the plan over the shared GpuShared."""
    moe_class = GpuMoEOps                   # the parts' classes (a tensor-parallel rank's ops replace the MoE one)
    mla_class = GpuMLAOps
    lora_class = GpuLoRAOps
    op_ranges = layer_ranges = False        # NVTX ranges per op / per decoder layer (GpuTuning.nvtx; eager steps)
    kv_layer_events = None                  # per-layer events of a restore in flight (the executor sets them)
    attention_hook = None                   # the piecewise graphs' capture (hooked_attention)

    def __init__(self, plan, shared, arena, lm_head_ptr: int, lora_weights: dict | None = None,
                 state: dict | None = None):
        """plan: gpu_plan.GpuPlan; shared: the executor's GpuShared; arena: what the ops' buffers are carved
        from; lm_head_ptr: the lm_head weight's address (its product is float32 logits); lora_weights: site
        -> its weight extended with every slot's A rows (the upload); state: the line's state slot arrays."""
        self.shared = shared
        self.lm_head_ptr = lm_head_ptr
        self.num_heads, self.head_dim = plan.num_heads, plan.head_dim
        tuning = plan.options.gpu
        self.fast_attention = parse_decode_kernels(tuning.decode_kernels)[0]   # paged_decode.cu, else the split kernel
        self.layer_ranges, self.op_ranges = tuning.nvtx in ("layers", "ops"), tuning.nvtx == "ops"
        b = arena.take_all("activations", self.buffers(plan))
        self.logits_buf = b["logits"]
        self.part_out, self.part_max, self.part_sum = b["attn_part_out"], b["attn_part_max"], b["attn_part_sum"]
        self.split_counters = b["attn_split_counters"]      # paged_decode.cu's split tickets: zero between launches
        shared.zero(self.split_counters)
        self.k_embed = kernel("embedding", "embedding_gather")
        self.k_rms = kernel("rms_norm", "rms_norm_residual")
        self.k_rms_splitk = kernel("rms_norm", "splitk_rms_norm_residual")
        self.k_rope = kernel("qk_norm_rope_cache", "qk_norm_rope_cache" + shared.kv_entry)   # bf16 or e4m3 cache
        self.k_silu = kernel("silu_mul", "silu_mul")
        self.k_bias = kernel("add_bias", "add_bias")
        self.k_add = kernel("add_bias", "residual_add")
        self.k_attn = kernel("paged_attention", "paged_attention_split")
        self.k_merge = kernel("paged_attention", "attention_merge")
        self._decode_kernels: dict[tuple, object] = {}     # (group, entry, heads, defines) -> kernel
        self._build_families(plan, arena, lora_weights, state)

    def _build_families(self, plan, arena, lora_weights, state) -> None:
        """The parts of the families the plan's line uses (their buffers carved in this order)."""
        shared, families = self.shared, plan.families
        self.moe = self._moe_part(plan, arena) if "moe" in families else None
        self.mla = self.mla_class(plan, shared, arena, self) if "mla" in families else None
        self.lora = self.lora_class(plan, shared, arena, lora_weights, self.rms_norm) if "lora" in families else None
        self.deltanet = GpuDeltaNetOps(shared, state) if "deltanet" in families else None
        self.dsv4 = GpuDSV4Ops(shared, self.moe, state) if "dsv4" in families else None

    def _moe_part(self, plan, arena) -> GpuMoEOps:
        return self.moe_class(plan, self.shared, arena)

    # ---- buffers -----------------------------------------------------------------------------
    @staticmethod
    def buffers(plan) -> list[Buffer]:
        """The logits and the attention split partials (the activation ring and the residual: GpuShared's)."""
        part_rows = (plan.max_tokens + 2 * plan.device.num_sms) * plan.num_heads
        return [Buffer("logits", (plan.logit_rows, plan.vocab), np.float32),
                Buffer("attn_part_out", (part_rows * plan.head_dim,), np.float32),
                Buffer("attn_part_max", (part_rows,), np.float32),
                Buffer("attn_part_sum", (part_rows,), np.float32),
                Buffer("attn_split_counters", (plan.max_tokens * plan.num_heads,), np.int32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        """The activation buffers (GpuShared's and these) and the families' of the plan's line."""
        return buffers_nbytes(activation_buffers(plan) + cls.buffers(plan)) + cls.families_nbytes(plan)

    @classmethod
    def families_nbytes(cls, plan) -> int:
        return cls.moe_class.nbytes(plan) + cls.mla_class.nbytes(plan) + cls.lora_class.nbytes(plan)

    def _out(self, rows: int, cols: int):
        return self.shared.out(rows, cols)

    def _launch(self, k, grid, block, args) -> None:
        self.shared.launch(k, grid, block, args)

    def reset(self, at: int = 0) -> None:
        """Start a forward at ring slot `at` (0: a captured graph sees the same addresses on replay)."""
        self.shared.ring_next = at

    @property
    def ring_position(self) -> int:
        """The activation ring's next slot (the piecewise graphs put it back after a replay)."""
        return self.shared.ring_next

    def activation(self, rows: int, cols: int):
        """The next activation buffer [rows, cols] (an attention output the prefill path or the piecewise
        graphs hand out)."""
        return self._out(rows, cols)

    @contextlib.contextmanager
    def hooked_attention(self, hook):
        """attention(q, spec, ctx, out) calls hook(q, spec, ctx) instead while inside (the piecewise graphs'
        capture leaves each attention call out of its segments, gpu_piecewise.py)."""
        self.attention_hook = hook
        try:
            yield
        finally:
            self.attention_hook = None

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
            if T > self.logits_buf.shape[0]:
                raise ValueError(f"{T} logit rows exceed the {self.logits_buf.shape[0]} the logits buffer holds")
            out = self.logits_buf[:T]
        else:
            out = self._out(T, N)
        self.shared.gemm(x, weight, out, pdl=self.shared.pdl)
        if bias is not None:
            total = T * N
            self._launch(self.k_bias, (min(1024, -(-total // 256)),), (256,),
                         (out, bias, np.int32(N), np.int64(total)))
        return out

    @op_range
    def qkv_rope_cache(self, qkv, spec: AttentionSpec, ctx: GpuStepContext, q_norm=None, k_norm=None):
        T, sh = ctx.num_tokens, self.shared
        Hq, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q = self._out(T, Hq * D).reshape(T, Hq, D)
        kc, vc = sh.kv_cache[spec.layer, 0], sh.kv_cache[spec.layer, 1]
        null = np.uint64(0)
        # a block per token shares one cos / sin table (qk_norm_rope_cache.cu; a warp serves
        # rope_heads_per_warp heads at once), split into head groups only while the tokens alone do not fill
        # the SMs twice
        warps = 8
        groups = 1 if T >= 2 * sh.num_sms else -(-(Hq + 2 * Hkv) // (warps * rope_heads_per_warp(D)))
        self._launch(self.k_rope, (T, groups), (32 * warps,),
                     (qkv, q_norm if q_norm is not None else null, k_norm if k_norm is not None else null,
                      np.float32(spec.rms_eps), sh.inv_freq, np.float32(sh.attention_factor),
                      ctx.positions, ctx.slot_mapping, q, kc, vc, np.int32(Hq), np.int32(Hkv), np.int32(D))
                     + sh.kv_scales(spec.layer))
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
                                               **defines)
        return self._decode_kernels[key]

    def _heads_per_cta(self, num_tokens: int, num_kv_heads: int) -> int:
        """paged_decode.cu's query heads per CTA for a step of num_tokens query rows (decode_heads_per_cta)."""
        group = self.num_heads // num_kv_heads
        return decode_heads_per_cta(num_tokens, num_kv_heads, group, self.shared.num_sms)

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
        (the composition runs; both give the same bits; an FP8 cache takes the composition)."""
        if (not ctx.decode_only or spec.head_dim != self.head_dim or self.shared.kv_format.fp8
                or spec.num_heads != self.num_heads
                or ctx.num_splits * spec.num_kv_heads * ctx.num_tokens > FUSED_ROPE_CTAS_PER_SM * self.shared.num_sms):
            return None
        return self._decode_launch(spec, ctx, entry, **defines)

    def splits(self, num_tokens: int, num_kv_heads: int, max_context: int) -> int:
        """The step's KV split count for the attention kernel in use."""
        group, num_sms = self.num_heads // num_kv_heads, self.shared.num_sms
        fast = self.fast_attention and decode_attention_fits(group, self.head_dim)
        mla = self.mla is not None          # mla_decode.cu sizes its own head groups
        if mla and num_tokens == 1:
            # A batch-1 MLA step takes up to 32 splits (mla_decode_shape then gives 2 heads a CTA):
            # DeepSeek-V2-Lite in a graph, 1k / 4k keys, 21.7 / 53.2 -> 19.7 / 37.5 µs a layer; at 8 tokens
            # 16 stays better (49.6 against 61.3 at 1k keys) (H200, bench/moe_micro.py, 2026-12-04 19:45 UTC).
            return attention_splits(1, num_kv_heads, max_context, MLA_MAX_SPLITS, num_sms)
        groups = group // self._heads_per_cta(num_tokens, num_kv_heads) if fast and not mla else 1
        return attention_splits(num_tokens, num_kv_heads, max_context, MAX_DECODE_SPLITS if fast else MAX_SPLITS,
                                num_sms, groups)

    def _check_attention(self, spec: AttentionSpec, ctx: GpuStepContext) -> None:
        Hq, Hkv, D, S = spec.num_heads, spec.num_kv_heads, spec.head_dim, ctx.num_splits
        if Hq // Hkv > MAX_GROUP or D > MAX_HEAD_DIM or D % 2 or Hq % Hkv:
            raise ValueError(f"attention kernel supports an even D <= {MAX_HEAD_DIM}, "
                             f"Hq/Hkv <= {MAX_GROUP}; got Hq={Hq}, Hkv={Hkv}, D={D}")
        if ctx.num_tokens * Hq * S > self.part_max.shape[0] or S > MAX_DECODE_SPLITS:
            raise ValueError(f"attention partials: {ctx.num_tokens} tokens x {S} splits exceed the buffer")

    def check_partials(self, tokens: int, heads: int, splits: int) -> None:
        """The attention split partials hold tokens x heads x splits rows (else ValueError)."""
        if tokens * heads * splits > self.part_max.shape[0]:
            raise ValueError(f"attention partials: {tokens} tokens x {splits} splits x {heads} heads exceed the buffer")

    def _decode_args(self, spec: AttentionSpec, ctx: GpuStepContext, out) -> tuple:
        """paged_decode.cu's arguments from the KV cache on (the same for every entry; an FP8 cache's scales last)."""
        kv = self.shared.kv_cache
        return (kv[spec.layer, 0], kv[spec.layer, 1], ctx.block_tables, np.int32(ctx.block_tables.shape[1]),
                ctx.token_seq, ctx.positions, self.part_out, self.part_max, self.part_sum, out, self.split_counters,
                np.int32(spec.num_kv_heads), np.float32(spec.scale)) + self.shared.kv_scales(spec.layer)

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
        null, sh = np.uint64(0), self.shared
        out = self._out(ctx.num_tokens, spec.num_heads * spec.head_dim)
        self._launch(*fused, (128,),
                     rows + (q_norm if q_norm is not None else null, k_norm if k_norm is not None else null,
                             np.float32(spec.rms_eps), sh.inv_freq, np.float32(sh.attention_factor),
                             ctx.slot_mapping) + self._decode_args(spec, ctx, out))
        return out

    def qkv_rope_attention(self, x, norm_weight, eps, weight, bias, spec, ctx, normed=None, q_norm=None, k_norm=None,
                           lora=None):
        """A decode step with a LoRA adapter at the q/k/v site: the product by the extended weight, then
        paged_decode.cu's rope_paged_decode_attention_lora adding each row's delta in its prologue; else the
        composition (norm_linear, rope_attention)."""
        fused = self._lora_attention_kernel(spec, ctx, lora, x.shape[0]) if bias is None else None
        if fused is None:
            return super().qkv_rope_attention(x, norm_weight, eps, weight, bias, spec, ctx, normed=normed,
                                              q_norm=q_norm, k_norm=k_norm, lora=lora)
        wide = self.lora.extended_product(x, norm_weight, eps, lora, normed)
        return self._rope_decode(fused, self.lora.attention_rows(wide, lora), spec, ctx, q_norm, k_norm)

    def _lora_attention_kernel(self, spec: AttentionSpec, ctx: GpuStepContext, site, rows: int):
        """The fused rope + decode attention entry that adds a q/k/v site's delta, or None. Decode steps add it
        there (its _lora entry reads the extended product's rows) instead of a compacting lora_expand.cu launch
        before attention: batch 1 / 4 adapters +6.2% -> +4.7% of the graph step, batch 32 unchanged (H200,
        bench/results/lora.md, 2026-12-04 19:27; bench/lora.py --qkv-compaction runs the other path)."""
        lora = self.lora
        if lora is None or not lora.fused(site, rows) or len(lora.sites[site].slices) != 3:
            return None
        return self._rope_decode_kernel(spec, ctx, "rope_paged_decode_attention_lora", LORA_R=lora.rank)

    @op_range
    def attention(self, q, spec: AttentionSpec, ctx: GpuStepContext, out=None):
        """o[T, Hq·D] into `out` (default: the next activation buffer; piecewise graphs pass the rows
        their next segment reads)."""
        if self.attention_hook is not None:
            return self.attention_hook(q, spec, ctx)
        self._kv_layer_ready(spec.layer)
        if ctx.prefill is not None and ctx.prefill.serves(spec):     # long sequences: CuTe (gpu_prefill.py)
            return ctx.prefill.attention(self, q, spec, ctx, out)
        if out is None:
            out = self._out(ctx.num_tokens, spec.num_heads * spec.head_dim)
        self.paged_attention(q, spec, ctx, out)
        return out

    def _kv_layer_ready(self, layer: int) -> None:
        """A host-tier restore copying layer by layer (GpuHostCopies._restore_by_layer): wait for this layer's."""
        if self.kv_layer_events is not None:
            self.shared.stream.wait_event(self.kv_layer_events[layer])

    def paged_attention(self, q, spec: AttentionSpec, ctx: GpuStepContext, out) -> None:
        """out[T, Hq·D] = attention of ctx's T query rows over the paged cache (paged_decode.cu where it
        fits, else paged_attention_split + attention_merge; an FP8 cache: paged_decode_attention_fp8)."""
        self._check_attention(spec, ctx)
        kv, entry = self.shared.kv_cache, "paged_decode_attention" + self.shared.kv_entry
        fast = self._decode_launch(spec, ctx, entry) if spec.head_dim == self.head_dim else None
        if fast is not None or self.shared.kv_format.fp8:       # FP8: paged_decode.cu's (gpu_kv_format.py checks)
            self._launch(*fast, (128,), (q,) + self._decode_args(spec, ctx, out))
            return
        self.split_attention(q, kv[spec.layer, 0], kv[spec.layer, 1], ctx.block_tables, spec.num_heads,
                             spec.num_kv_heads, spec.head_dim, spec.scale, ctx, out)

    def split_attention(self, q, k, v, tables, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                        ctx: GpuStepContext, out) -> None:
        """paged_attention_split of ctx's query rows over k, v [blocks · 16, heads, dim] by block `tables`,
        then attention_merge of its ctx.num_splits splits into out [T, heads · dim] (MLA's expanded form too)."""
        T, S = ctx.num_tokens, ctx.num_splits
        self._launch(self.k_attn, (S, num_kv_heads, T), (128,),
                     (q, k, v, tables, np.int32(tables.shape[1]), ctx.token_seq, ctx.positions, self.part_out,
                      self.part_max, self.part_sum, np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                      np.float32(scale)))
        self._launch(self.k_merge, (T * num_heads,), (128,),
                     (self.part_out, self.part_max, self.part_sum, out, np.int32(S), np.int32(head_dim)))

    @op_range
    def silu_mul(self, gate_up):
        T, two_i = gate_up.shape
        inter = two_i // 2
        out = self._out(T, inter)
        total = T * inter // 8
        self._launch(self.k_silu, (max(1, min(4096, -(-total // 256))),), (256,),
                     (gate_up, out, np.int32(inter), np.int64(total), np.int32(self.shared.gate_up_interleaved)))
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
        out = self.shared.residual_out(T, H)
        total = T * H // 8
        self._launch(self.k_add, (max(1, min(4096, -(-total // 256))),), (256,),
                     (x, residual, out, np.int64(total)))
        return out

    # ---- fused decode ops (gemv.cu), composed from the above where the GEMV does not serve ----
    def _lora_fused(self, site, rows: int) -> bool:
        """The step's product at `site` is by the LoRA-extended weight (gpu_lora_ops.py)."""
        return self.lora is not None and self.lora.fused(site, rows)

    def _lora_on(self, site) -> bool:
        return self.lora is not None and self.lora.on(site)

    @op_range
    def norm_linear(self, x, norm_weight, eps, weight, bias=None, normed=None, lora=None):
        """gemv.cu's RMSNorm prologue + product (a LoRA delta after it, its shrink norming x again);
        else the composition."""
        gemm = self.shared.gemm
        if bias is None and self._lora_fused(lora, x.shape[0]):
            return self.lora.norm_linear(x, norm_weight, eps, lora, normed)
        if normed is not None or bias is not None or not gemm.gemv_serves(x, weight):
            return super().norm_linear(x, norm_weight, eps, weight, bias, normed=normed, lora=lora)
        out = self._out(x.shape[0], weight.shape[0])
        gemm.gemv(x, weight, out, "norm", norm_w=norm_weight, eps=eps, pdl=self.shared.pdl)
        return self.lora.add(out, x, lora, norm=(norm_weight, eps)) if self._lora_on(lora) else out

    @op_range
    def norm_swiglu(self, x, norm_weight, eps, gate_up_weight, normed=None, lora=None):
        """gemv.cu's RMSNorm + product + SiLU·up in one kernel; else the CuTe GEMM's SiLU·up twin
        after the norm (one kernel fewer than product + silu_mul); else (and with a LoRA adapter in
        the step: the product, then lora_expand.cu's SiLU·up with the delta added first) the composition."""
        rows, sh = x.shape[0], self.shared
        if self._lora_fused(lora, rows):
            return self.lora.norm_swiglu(x, norm_weight, eps, lora, normed)
        if self._lora_on(lora):
            return self.lora.unfused_swiglu(x, norm_weight, eps, gate_up_weight, normed, lora)
        if sh.gate_up_interleaved and sh.gemm.gemv_serves(x if normed is None else normed, gate_up_weight):
            out = self._out(rows, gate_up_weight.shape[0] // 2)
            if normed is None:
                sh.gemm.gemv(x, gate_up_weight, out, "norm_silu", norm_w=norm_weight, eps=eps, pdl=sh.pdl)
            else:               # normed already (the MoE lines' shared experts): SiLU·up without the norm
                sh.gemm.gemv(normed, gate_up_weight, out, "silu", pdl=sh.pdl)
            return out
        if not (sh.gate_up_interleaved and sh.gemm.cute_fuses_swiglu(rows, gate_up_weight)):
            return super().norm_swiglu(x, norm_weight, eps, gate_up_weight, normed=normed)
        if normed is None:
            normed, _ = self.rms_norm(x, norm_weight, eps)
        out = self._out(rows, gate_up_weight.shape[0] // 2)
        sh.gemm.cute_swiglu(normed, gate_up_weight, out)
        return out

    @op_range
    def add_linear(self, x, weight, residual, bias=None, lora=None):
        """The residual add in the product (gemv.cu's epilogue, cuBLAS beta = 1); a LoRA delta is added
        into the sum after it."""
        if bias is not None:
            return super().add_linear(x, weight, residual, bias, lora=lora)
        sh = self.shared
        out = sh.residual_out(x.shape[0], weight.shape[0])
        if sh.gemm.gemv_serves(x, weight):
            sh.gemm.gemv(x, weight, out, "res", res_in=residual, pdl=sh.pdl)
            return self.lora_add(out, x, lora)
        if residual.data.ptr != out.data.ptr:  # the first layer's residual is the embedding output
            sh.copy(out, residual)
        sh.gemm(x, weight, out, accumulate=True)  # cuBLAS beta = 1: the add in the product's epilogue
        return self.lora_add(out, x, lora)

    @op_range
    def add_linear_norm(self, x, weight, residual, norm_weight, eps, bias=None, lora=None):
        """Where the CuTe GEMM's plan splits the product in K: the split GEMM, then one kernel that
        reduces its partials, adds the residual and applies the RMSNorm after it
        (rms_norm.cu splitk_rms_norm_residual), a LoRA delta added into the first partial before it;
        elsewhere add_linear, the norm left to the next op."""
        if bias is None and self._lora_fused(lora, x.shape[0]):
            return self.lora.add_linear_norm(x, lora, residual, norm_weight, eps)
        gemm = self.shared.gemm
        fusable = bias is None and not gemm.gemv_serves(x, weight)
        partials = gemm.cute_partials(x, weight, residual) if fusable else None
        if partials is None:
            return self.add_linear(x, weight, residual, bias, lora=lora), None
        T, N = x.shape[0], weight.shape[0]
        out, normed = self.shared.residual_out(T, N), self._out(T, N)
        splits, _, _ = partials.shape
        self.reduce_partials(partials)
        if self._lora_on(lora):
            if tuple(partials.shape[1:]) != (T, N) or tuple(partials.strides[1:]) != (N, 1):
                raise ValueError(f"split-K partials {partials.shape} / {partials.strides}: not [S, {T}, {N}] rows")
            self.lora.add(None, x, lora, into=partials.ptr)
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
        return gpu_graphs.nvtx_range(f"layer {layer}")
