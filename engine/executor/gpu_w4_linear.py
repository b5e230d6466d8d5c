"""INT4 W4A16 linear layers on the GPU: the int4 part of the quantized-linear family (ops.w4; gpu_quant_ops.py routes
a kept int4 weight, engine/models/quant_linear.py W4Linear uploaded as a W4Weight, to it).

The codes stay packed in the kernel's layout (openinfer_kernels/quant/w4_layout.py pack_w4, re-packed once at load;
a gate_up weight's rows interleaved by 8 first where the executor interleaves gate_up). Decode rows (at most
GEMV_MAX_M) multiply through gemv_w4.cu, which dequantizes in registers, with its epilogues (bf16, the residual
add, SiLU·up); larger steps dequantize the weight into one bf16 scratch buffer (w4_dequant.cu) and run the bf16
dense op on it (cuBLAS / the CuTe GEMM): exact to the dequantized weights up to bf16 accumulation either way.
"""
from __future__ import annotations

import numpy as np

from engine.executor.gpu_gemm import interleave_gate_up
from engine.models.quant_experts import W4Experts
from engine.models.quant_linear import W4Linear
from memory.device_arena import Buffer, buffers_nbytes
from openinfer_kernels.quant.ops import QuantOps, W4Weight
from openinfer_kernels.quant.w4_formats import W4Codes, expert_codes
from openinfer_kernels.quant.w4_layout import pack_w4


def interleaved_codes(w: W4Codes) -> W4Codes:
    """A gate_up weight's rows (codes, scales, zeros) in blocks of 8 gate / 8 up rows."""
    zeros = None if w.zeros is None else interleave_gate_up(w.zeros)
    return W4Codes(interleave_gate_up(w.codes), interleave_gate_up(w.scales), w.scale_dtype, zeros, w.group, w.fp4)


def upload_w4(arena, weights: dict, stream, interleave) -> dict[str, W4Weight]:
    """The kept 4-bit weights (W4Linear, or W4Experts: one W4Weight of E experts) into the arena in the kernel's layout
    (interleave(name): gate_up rows interleaved)."""
    out = {name: _upload_packed(arena, name, w.w4, stream, interleave(name)) for name, w in weights.items()}
    stream.synchronize()
    return out


def _upload_packed(arena, name: str, w: W4Codes, stream, interleave: bool) -> W4Weight:
    """w (codes [N, K] or stacked [E, N, K]) re-packed one expert at a time (the packing's temporaries stay one
    expert's size) into arena arrays holding the experts' layouts one after another."""
    lead = w.codes.shape[:-2]
    dev, weight = {}, None
    for e in range(lead[0] if lead else 1):
        piece = expert_codes(w, e) if lead else w
        p = pack_w4(interleaved_codes(piece) if interleave else piece)
        if weight is None:
            for part in ("codes", "scales", "zeros"):
                a = getattr(p, part)
                if a is not None:
                    dev[part] = arena.take(f"weights.{name}.{part}", (*lead, *a.shape), a.dtype)
            weight = W4Weight(dev["codes"], dev["scales"], dev.get("zeros"), p.n, p.k, p.group,
                              tuple(sorted(p.defines.items())), lead[0] if lead else 1)
        for part, dst in dev.items():
            (dst[e] if lead else dst).set(np.ascontiguousarray(getattr(p, part)), stream=stream)
    return weight


def w4_device_nbytes(w: W4Linear | W4Experts) -> int:
    """The packed layout's bytes (padded to whole tiles; experts one after another) and the carve alignment."""
    *lead, N, K = w.shape
    tiles, steps = -(-N // 16), -(-K // 128)
    groups = -(-steps * 128 // w.w4.group)
    per_group = tiles * groups * 16
    return int(np.prod(lead, dtype=np.int64)) * (tiles * steps * 1024 + per_group * (2 + (w.w4.zeros is not None))) + 3 * 256


class GpuW4Linear:
    """ops.w4: gemv(x, w, out, epi, res) for decode rows; bf16(w), the weight dequantized into the scratch buffer
    (valid until the next bf16 call) for the bf16 dense ops."""
    quant_ops_class = QuantOps

    def __init__(self, plan, shared, arena):
        self.shared = shared
        self.scratch = arena.take_all("w4", self.buffers(plan))["scratch"]
        shared.gemm.mark_rewritten(self.scratch)        # w4_dequant writes it just before each product
        self.kernels = self.quant_ops_class(shared.stream)

    @staticmethod
    def buffers(plan) -> list[Buffer]:
        """One bf16 scratch of the largest linear weight (its K rounded up to 8: w4_dequant.cu's row stride)."""
        size = max([n * -(-k // 8) * 8 for n, k in plan.linear_shapes] + [8])
        return [Buffer("scratch", (size,), np.uint16)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.buffers(plan))

    def gemv(self, x, w: W4Weight, out, epi: str = "bf16", res=None) -> None:
        self.kernels.pdl = self.shared.pdl
        self.kernels.gemv_w4(x, w, out, epi, res)

    def bf16(self, w: W4Weight):
        ld = -(-w.k // 8) * 8
        out = self.scratch[:w.n * ld].reshape(w.n, ld)
        self.kernels.pdl = self.shared.pdl
        self.kernels.dequant_w4(w, out)
        return out[:, :w.k]
