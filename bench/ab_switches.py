"""The A/B switches the benchmarks (and the tests of the paths they switch) flip on the GPU executor, kept off
the production objects: subclasses of the executor's parts that add each switch and the override it needs.
ABGpuExecutor(model, options) is a GpuExecutor built from them; its switches, each off by default (the
production path):

    ex.ops.fused_rope = False          rope + KV write, then decode attention: two kernels (bench/decode.py |norope)
    ex.ops.decode_defines = {...}      paged_decode.cu build options (STAGES, MIN_CTAS: bench/decode.py |pd1)
    ex.ops.decode_heads = n            paged_decode.cu query heads per CTA (|wholegroup, bench/decode_micro.py)
    ex.ops.lora_in_attention = False   the q/k/v LoRA delta compacted before attention (bench/lora.py --qkv-compaction)
    ex.ops.mla.group = G               mla_decode.cu query heads per CTA (bench/moe_micro.py)
    ex.graphs.sample_in_graph = False  sampling steps sample eagerly after the greedy graph (bench/graph_sampling.py)
    ex.set_decode_kernels(spec)        GpuTuning.decode_kernels switched between steps (bench/decode.py --kernels)
"""
from __future__ import annotations

from engine.executor.gpu import GpuExecutor
from engine.executor.gpu_graphs import DecodeGraphs
from engine.executor.gpu_mla_ops import MLA_MAX_GROUP, GpuMLAOps
from engine.executor.gpu_ops import GpuOps
from engine.executor.gpu_verify_graphs import build_verify_graphs
from engine.executor.options import parse_decode_kernels


class ABMLAOps(GpuMLAOps):
    group = None                    # mla_decode.cu heads per CTA (None: mla_decode_shape's)

    def _decode_shape(self, tokens: int, splits: int, heads: int) -> tuple[int, int]:
        S, G = super()._decode_shape(tokens, splits, heads)
        return S, (min(self.group, MLA_MAX_GROUP, heads) if self.group else G)


class ABGpuOps(GpuOps):
    mla_class = ABMLAOps
    fused_rope = True               # rope_attention in one kernel on decode steps
    decode_defines: dict = {}       # paged_decode.cu's extra -D options
    decode_heads = 0                # > 0: paged_decode.cu's heads per CTA
    lora_in_attention = True        # the q/k/v LoRA delta inside the fused attention entry

    def _decode_kernel(self, num_kv_heads: int, entry: str = "paged_decode_attention", heads: int = 0, **defines):
        return super()._decode_kernel(num_kv_heads, entry, heads, **self.decode_defines, **defines)

    def _heads_per_cta(self, num_tokens: int, num_kv_heads: int) -> int:
        return self.decode_heads or super()._heads_per_cta(num_tokens, num_kv_heads)

    def _rope_decode_kernel(self, spec, ctx, entry="rope_paged_decode_attention", **defines):
        return super()._rope_decode_kernel(spec, ctx, entry, **defines) if self.fused_rope else None

    def _lora_attention_kernel(self, spec, ctx, site, rows: int):
        return super()._lora_attention_kernel(spec, ctx, site, rows) if self.lora_in_attention else None


class ABDecodeGraphs(DecodeGraphs):
    sample_in_graph = True          # False: the steps the sampling graph serves sample eagerly instead

    def mode(self, seqs) -> str:
        mode = super().mode(seqs)
        return "eager" if mode == "sampling" and not self.sample_in_graph else mode


class ABGpuExecutor(GpuExecutor):
    ops_class = ABGpuOps
    graphs_class = ABDecodeGraphs

    def set_decode_kernels(self, spec: str) -> None:
        """Switch the decode kernels (GpuTuning.decode_kernels) between steps; drops captured graphs."""
        fast_attention, gemv_max_m = parse_decode_kernels(spec, self.default_gemv_rows())
        self.stream.synchronize()
        self.ops.fast_attention, self.gemm.gemv_max_m = fast_attention, gemv_max_m
        if self.graphs is not None:
            self.graphs = self._graphs()
        if self.lora_graphs is not None:
            self.lora_graphs = self._graphs()
        if self.piecewise is not None:
            self.piecewise.graphs.clear()
        self.verify_graphs = build_verify_graphs(self)
