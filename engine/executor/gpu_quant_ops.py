"""The quantized-linear op family on the GPU: GpuOps whose dense linear ops take a kept FP8 weight (Fp8Device:
gpu_fp8_ops.py, ops.fp8, W8A8) or a kept int4 one (W4Weight: gpu_w4_linear.py, ops.w4, W4A16) through that part,
and every other weight as GpuOps does. The executor runs this class for a model that keeps quantized linear
layers (quant_ops_class); the model lines pass the weights as they are, never branching on the format.

Upload: upload_quantized puts the kept weights into the arena (FP8: uint8 codes + float32 scales; int4: the packed
layout), the rest goes through memory/weight_upload.py as bf16. Block-scaled FP8 gate_up weights cannot be
interleaved (a 128-row scale block would mix gate and up rows): the executor then stores every gate_up
uninterleaved (gate_up_interleaved), and the SiLU·up kernels read them so.
"""
from __future__ import annotations

import numpy as np

from engine.executor.gpu_fp8_ops import Fp8Device, GpuFp8Linear, upload_fp8
from engine.executor.gpu_ops import GpuOps, op_range
from engine.executor.gpu_quant_moe import GpuQuantMoEOps, fp8_experts_nbytes, kept_experts_kernels, upload_experts
from engine.executor.gpu_w4_linear import GpuW4Linear, upload_w4, w4_device_nbytes
from engine.models.quant_experts import KEPT, Fp8Experts, W4Experts, log_kept
from engine.models.quant_linear import Fp8Linear, W4Linear
from openinfer_kernels.quant.ops import GEMV_MAX_M, W4Weight
from openinfer_kernels.quant.fp8_ref import GROUP


def device_nbytes(w) -> int:
    """What one weight takes in the arena: a kept one its packed codes and scales, any other its bf16 values."""
    if isinstance(w, (W4Linear, W4Experts)):
        return w4_device_nbytes(w)
    if isinstance(w, Fp8Experts):
        return fp8_experts_nbytes(w)
    if isinstance(w, Fp8Linear):
        N, K = w.shape
        return N * K + int(w.scale.nbytes) + 4 * -(-N // GROUP) * (K // GROUP) + 3 * 256
    return int(w.size) * 2


def block_scaled_gate_up(weights: dict) -> bool:
    """A gate_up weight (dense or experts) kept in FP8 with block scales: its rows cannot be interleaved."""
    return any(isinstance(w, (Fp8Linear, Fp8Experts)) and not w.channel
               for n, w in weights.items() if n.endswith("gate_up_proj"))


def upload_quantized(arena, weights: dict, stream, interleave) -> dict:
    """The kept weights of `weights` into the arena (interleave(name): its gate_up rows interleaved by 8), said
    per layer family in the startup log."""
    log_kept(weights, {Fp8Linear: "fp8_quant.cu + gemv_fp8.cu (decode), the CuTe FP8 GEMM (prefill)",
                       W4Linear: "gemv_w4.cu (decode), w4_dequant.cu + the bf16 GEMM (prefill)",
                       **kept_experts_kernels()})
    of = lambda kind: {n: w for n, w in weights.items() if isinstance(w, kind)}    # noqa: E731
    return {**upload_fp8(arena, of(Fp8Linear), stream, interleave),
            **upload_w4(arena, of((W4Linear, W4Experts)), stream, interleave),
            **upload_experts(arena, of(Fp8Experts), stream, interleave)}


def quant_ops_class(weights: dict, default: type[GpuOps]) -> type[GpuOps]:
    """GpuQuantOps for a model that keeps quantized linear layers, else `default`."""
    return GpuQuantOps if any(isinstance(w, KEPT) for w in weights.values()) else default


class GpuQuantOps(GpuOps):
    """GpuOps with the quantized-linear parts (ops.fp8, ops.w4) and the MoE part serving kept experts."""
    moe_class = GpuQuantMoEOps

    def __init__(self, plan, shared, arena, lm_head_ptr: int, lora_weights: dict | None = None, state=None):
        if "lora" in plan.families:
            raise ValueError("--enable-lora with quantized weights kept on the GPU is not supported (LoRA sites extend "
                             "bf16 weights)")
        super().__init__(plan, shared, arena, lm_head_ptr, lora_weights, state)
        self.fp8 = GpuFp8Linear(plan, shared, arena)
        self.w4 = GpuW4Linear(plan, shared, arena)

    @classmethod
    def families_nbytes(cls, plan) -> int:
        return super().families_nbytes(plan) + GpuFp8Linear.nbytes(plan) + GpuW4Linear.nbytes(plan)

    def _bias(self, out, bias):
        T, N = out.shape
        self._launch(self.k_bias, (min(1024, -(-T * N // 256)),), (256,), (out, bias, np.int32(N), np.int64(T * N)))
        return out

    def _decode_w4(self, weight, rows: int) -> bool:
        """A kept int4 weight on a step gemv_w4 serves (else its bf16 dequantization serves the dense op)."""
        return isinstance(weight, W4Weight) and rows <= GEMV_MAX_M

    def _bf16(self, weight):
        return self.w4.bf16(weight) if isinstance(weight, W4Weight) else weight

    @op_range
    def linear(self, x, weight, bias=None):
        if isinstance(weight, Fp8Device) or self._decode_w4(weight, x.shape[0]):
            fp8 = isinstance(weight, Fp8Device)
            out = self._out(x.shape[0], weight.shape[0] if fp8 else weight.n)
            if fp8:
                self.fp8.run(x, weight, out)
            else:
                self.w4.gemv(x, weight, out)
            return out if bias is None else self._bias(out, bias)
        return super().linear(x, self._bf16(weight), bias)

    @op_range
    def norm_linear(self, x, norm_weight, eps, weight, bias=None, normed=None, lora=None):
        if isinstance(weight, Fp8Device):
            out = self._out(x.shape[0], weight.shape[0])
            if normed is None:
                self.fp8.run(x, weight, out, norm_w=norm_weight, eps=eps)
            else:
                self.fp8.run(normed, weight, out)
            return out if bias is None else self._bias(out, bias)
        if self._decode_w4(weight, x.shape[0]):
            normed = normed if normed is not None else self.rms_norm(x, norm_weight, eps)[0]
            return self.linear(normed, weight, bias)
        return super().norm_linear(x, norm_weight, eps, self._bf16(weight), bias, normed=normed, lora=lora)

    @op_range
    def norm_swiglu(self, x, norm_weight, eps, gate_up_weight, normed=None, lora=None):
        w, rows = gate_up_weight, x.shape[0]
        if isinstance(w, Fp8Device):
            out = self._out(rows, w.shape[0] // 2)
            if normed is None:
                self.fp8.run(x, w, out, "silu", norm_w=norm_weight, eps=eps)
            else:
                self.fp8.run(normed, w, out, "silu")
            return out
        if self._decode_w4(w, rows):
            normed = normed if normed is not None else self.rms_norm(x, norm_weight, eps)[0]
            if not self.shared.gate_up_interleaved:
                return self.silu_mul(self.linear(normed, w))
            out = self._out(rows, w.n // 2)
            self.w4.gemv(normed, w, out, "silu")
            return out
        return super().norm_swiglu(x, norm_weight, eps, self._bf16(w), normed=normed, lora=lora)

    @op_range
    def add_linear(self, x, weight, residual, bias=None, lora=None):
        fp8, w4 = isinstance(weight, Fp8Device), self._decode_w4(weight, x.shape[0])
        if fp8 and bias is not None:                    # the composition: the quantized linear, then the add
            return self.add(self.linear(x, weight, bias), residual)
        if not (fp8 or w4) or bias is not None:
            return super().add_linear(x, self._bf16(weight), residual, bias, lora=lora)
        out = self.shared.residual_out(x.shape[0], weight.shape[0] if fp8 else weight.n)
        if fp8:
            self.fp8.run(x, weight, out, "residual", res=residual)
        else:
            self.w4.gemv(x, weight, out, "residual", res=residual)
        return out

    @op_range
    def add_linear_norm(self, x, weight, residual, norm_weight, eps, bias=None, lora=None):
        if isinstance(weight, Fp8Device) or self._decode_w4(weight, x.shape[0]):
            return self.add_linear(x, weight, residual, bias, lora=lora), None
        return super().add_linear_norm(x, self._bf16(weight), residual, norm_weight, eps, bias, lora=lora)
