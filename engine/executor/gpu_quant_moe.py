"""Routed experts kept quantized on the GPU: the MoE part GpuQuantOps builds (ops.moe), GpuMoEOps with the experts'
products on the quantized grouped GEMVs when a layer's stacked experts are kept (engine/models/quant_experts.py).

Upload (upload_experts): FP8 experts as uint8 e4m3 codes [E, N, K] with float32 scales per expert (Fp8ExpertsDevice);
4-bit ones (int4, FP4) in gemv_w4.cu's packed layout, the experts one after another (W4Weight, experts = E), a
gate_up's rows interleaved by 8 where the executor interleaves gate_up (block-scaled FP8 gate_up is not
interleaved: the executor turns interleaving off for the model, gpu_quant_ops.block_scaled_gate_up).

A step runs the routing, moe_align's grouping, the gather, the activation and the weighted combine as the bf16
experts do (gpu_moe_ops.py); each grouped product is one launch over the expert-grouped rows: gemv_w4_grouped
(W4A16, the weights dequantized in registers to bf16) or fp8_quant + gemv_fp8_grouped (W8A8: the rows quantized per
128-wide group, float32 accumulation, the block scales per K block). Grids depend on the step's token count only,
nothing waits on the host: decode steps capture in CUDA graphs as the bf16 ones do. The grouped GEMVs take any
rows per tile (16 at a time), so prefill can run them too, reading each routed expert's weights once per 16 of its
rows; a step whose experts average W4_GEMM_ROWS / FP8_GEMM_ROWS rows or more takes them to the grouped GEMMs
instead (w4_grouped_gemm.cu / fp8_grouped_gemm.cu: 64 rows a CTA sharing each weight block and one staged
activation tile).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.executor.gpu_fp8_ops import upload_fp8_parts
from engine.executor.gpu_moe_ops import GpuMoEOps, expert_rows
from engine.models.quant_experts import Fp8Experts, W4Experts
from memory.device_arena import Buffer
from openinfer_kernels.quant.fp8_ref import GROUP
from openinfer_kernels.quant.ops import WG_ROWS, QuantOps, W4Weight

# Steps whose experts average at least this many rows (tokens · top_k / experts) run kept experts on the grouped
# GEMMs, fewer on the GEMVs (bench/experts_prefill.py). 4-bit (H100 2026-12-07, V4-Flash / Kimi-K2 shapes): at
# 11-12 rows the GEMV 1.0-1.4x faster, at 43-48 the GEMM 1.6-2.4x, at 170-190 2.5-3.5x. FP8 (H200 2026-12-07,
# DeepSeek-V3 / Qwen3-30B-A3B shapes): at 16 rows the GEMM 1.9x faster, at 32 1.7-1.9x, at 64-130 2.4-4.0x
# (fewer rows not measured).
W4_GEMM_ROWS = 24
FP8_GEMM_ROWS = 16


@dataclass(frozen=True, eq=False)
class Fp8ExpertsDevice:
    """FP8 experts on the device: codes uint8 (e4m3 bits) [E, N, K], scale float32 [E, ceil(N/128), K/128] or
    [E, N] (gemv_fp8_grouped's)."""
    codes: object
    scale: object

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.codes.shape)


def upload_experts(arena, weights: dict, stream, interleave) -> dict:
    """The kept FP8 experts of `weights` into the arena (their 4-bit ones go with the dense int4 weights:
    gpu_w4_linear.upload_w4 stacks them as one W4Weight of E experts)."""
    out = {}
    for name, w in weights.items():
        dev = upload_fp8_parts(arena, name, w, stream, interleave(name))
        out[name] = Fp8ExpertsDevice(dev["codes"], dev["scale"])
    stream.synchronize()
    return out


def fp8_experts_nbytes(w: Fp8Experts) -> int:
    """What an Fp8Experts takes in the arena: its codes, its scales and the carve alignment."""
    return int(w.codes.size) + int(w.scale.nbytes) + 2 * 256


def has_fp8_experts(weights: dict) -> bool:
    """Routed experts kept in FP8 among the model's weights (GpuPlan.fp8_experts)."""
    return any(isinstance(w, Fp8Experts) for w in weights.values())


def kept_experts_kernels() -> dict[type, str]:
    """The startup log's kernels of the kept experts (engine/models/quant_experts.py log_kept)."""
    return {Fp8Experts: f"fp8_quant.cu + gemv_fp8_grouped (gemv_fp8.cu); fp8_grouped_gemm.cu at {FP8_GEMM_ROWS}+ "
                        f"rows an expert (prefill)",
            W4Experts: f"gemv_w4_grouped (gemv_w4.cu); w4_grouped_gemm.cu at {W4_GEMM_ROWS}+ rows an expert (prefill)"}


def grouped_gemm_tokens(experts: int, top_k: int, rows: int) -> int:
    """The fewest tokens a step takes to its kept experts' GEMMs: its experts then average `rows` rows."""
    return -(-rows * experts // top_k)


class GpuQuantMoEOps(GpuMoEOps):
    """ops.moe of a model that keeps quantized weights: bf16 experts as GpuMoEOps, kept ones on the quantized
    grouped GEMVs (their activations quantized into the fp8 row buffers first)."""
    quant_ops_class = QuantOps      # the quantized kernels' launches (the tests run a host emulation of them)

    def __init__(self, plan, shared, arena):
        super().__init__(plan, shared, arena)
        self.quant = self.quant_ops_class(shared.stream)
        s = plan.experts
        self.gemm_tokens = {W4Weight: grouped_gemm_tokens(s.num_experts, s.top_k, W4_GEMM_ROWS),
                            Fp8ExpertsDevice: grouped_gemm_tokens(s.num_experts, s.top_k, FP8_GEMM_ROWS)}

    @staticmethod
    def buffers(plan) -> list[Buffer]:
        """GpuMoEOps' and, with FP8 experts, the grouped rows quantized to e4m3 with their scales."""
        s = plan.experts
        if s is None or not plan.fp8_experts:
            return GpuMoEOps.buffers(plan)
        rows, width = expert_rows(plan.max_tokens, s.top_k, s.num_experts), max(s.hidden, s.inter)
        return GpuMoEOps.buffers(plan) + [Buffer("moe_aq", (rows * width,), np.uint8),
                                          Buffer("moe_aq_scales", (rows * -(-width // GROUP),), np.float32)]

    @staticmethod
    def expert_dims(w) -> tuple[int, int, int]:
        return (w.experts, w.n, w.k) if isinstance(w, W4Weight) else tuple(w.shape)

    @staticmethod
    def fusable(w) -> bool:
        return not isinstance(w, (W4Weight, Fp8ExpertsDevice))

    def grouped_linear(self, a, w, tile_expert, row_token, out, tile_m: int, tokens: int) -> None:
        """out[r] = a[r] · w[tile_expert[r // tile_m]]ᵀ: the quantized grouped GEMVs for kept experts."""
        self.quant.pdl = self.shared.pdl
        if not isinstance(w, (W4Weight, Fp8ExpertsDevice)):
            super().grouped_linear(a, w, tile_expert, row_token, out, tile_m, tokens)
            return
        gemm = tokens >= self.gemm_tokens[type(w)] and tile_m % WG_ROWS == 0
        if isinstance(w, W4Weight):
            product = self.quant.w4_grouped_gemm if gemm else self.quant.gemv_w4_grouped
            product(a, w, tile_expert, row_token, out, tile_m)
        else:
            rows, K = a.shape
            aq = self.buf["moe_aq"][:rows * K].reshape(rows, K)
            scales = self.buf["moe_aq_scales"][:K // GROUP * rows].reshape(K // GROUP, rows)
            self.quant.fp8_quant(a, aq, scales)
            product = self.quant.fp8_grouped_gemm if gemm else self.quant.gemv_fp8_grouped
            product(aq, scales, w.codes, w.scale, tile_expert, row_token, out, tile_m)
