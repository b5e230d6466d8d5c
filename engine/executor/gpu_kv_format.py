"""The GPU executor's KV format (--kv-cache-dtype, memory/kv_format.py): bf16, or e4m3 bytes written by
qk_norm_rope_cache.cu's qk_norm_rope_cache_fp8 and read by paged_decode.cu's paged_decode_attention_fp8 (decode,
chunks and the rows the CuTe prefill does not take) and kv_gather.cu's kv_gather_fp8 (the CuTe prefill's bf16
staging: the gathered context widened once per step and layer, ~2 bytes read and 4 written per cached value).
The fused rope + decode entries and paged_chunk.cu keep the bf16 cache only: with FP8 a decode step runs
qk_norm_rope_cache_fp8 then the attention (one launch more a layer), and short runs take paged_decode.cu.
MLA lines keep their one latent plane as e4m3 (k_scale): gpu_mla_ops.py's kernels each have an FP8 form.
"""
from __future__ import annotations

from engine.executor.attention_grid import decode_attention_fits
from engine.executor.options import parse_decode_kernels
from engine.loader.kv_scales import kv_format_of
from memory.kv_format import KVFormat


def fp8_kv_problem(families, group: int, head_dim: int, fast_attention: bool) -> str | None:
    """Why the GPU kernels cannot keep this line's KV as FP8 (--kv-cache-dtype fp8), None where they can: the
    e4m3 cache is written by qk_norm_rope_cache.cu's 16-byte-piece path and read by paged_decode.cu
    (paged_decode_attention_fp8) and kv_gather.cu (kv_gather_fp8, the CuTe prefill's staging); an MLA line's
    latent rows by the FP8 forms of gpu_mla_ops.py's kernels (whatever rows GpuMLAOps takes)."""
    if "mla" in families:
        return None
    if not fast_attention:
        return "the FP8 cache is read by paged_decode.cu: OPENINFER_DECODE_KERNELS must include attention"
    pieces = head_dim // 8
    if not decode_attention_fits(group, head_dim) or head_dim % 8 or not 2 <= pieces <= 32 or pieces & (pieces - 1):
        return f"paged_decode.cu / qk_norm_rope_cache.cu's FP8 paths do not take group {group} x head_dim {head_dim}"
    return None


def gpu_kv_format(kv_cache_dtype: str, model, plan) -> KVFormat:
    """The KV format the GPU executor stores for a LoadedModel; ValueError naming the flag where the line's
    kernels cannot read FP8."""
    fmt = kv_format_of(kv_cache_dtype, model)
    fast_attention = parse_decode_kernels(plan.options.gpu.decode_kernels)[0]
    problem = fmt.fp8 and fp8_kv_problem(plan.families, plan.num_heads // plan.kv.heads, plan.kv.dim, fast_attention)
    if problem:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} on the GPU: {problem}")
    return fmt
