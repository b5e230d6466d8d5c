"""FP8 W8A8 linear layers on the GPU: the FP8 part of the quantized-linear family (ops.fp8; gpu_quant_ops.py routes
a kept FP8 weight, engine/models/quant_linear.py Fp8Linear uploaded as Fp8Device, to it).

A product x · Wᵀ quantizes x per token and 128-wide group to e4m3 (openinfer_kernels/raw_cuda/fp8_quant.cu; with
the RMSNorm before it fused in, rms_norm_residual_fp8_quant, where the dense path fuses the norm into the
GEMV), then multiplies: decode rows (at most GEMV_MAX_M) through gemv_fp8.cu with its epilogues (bf16, the
residual add, SiLU·up on gate_up rows interleaved by 8), larger steps through the CuTe block-scaled FP8 GEMM
(openinfer_kernels/cute fp8_gemm; a channel-scaled weight multiplies it with unit block scales, its row scales
after, one more bf16 rounding), the residual add and SiLU·up by their own kernels after it. Without the CuTe
library the larger steps run gemv_fp8 16 rows at a time. Every buffer is carved at start, every launch on the
compute stream: decode steps capture as CUDA graphs as the bf16 ones do.

Block-scaled gate_up weights are not interleaved (a 128-row scale block would mix gate and up rows): the executor
then turns gate_up interleaving off for the model (gemv_fp8's SiLU·up epilogue serves channel-scaled ones only).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.executor.gpu_gemm import interleave_gate_up
from engine.models.quant_experts import Fp8Experts
from engine.models.quant_linear import Fp8Linear
from memory.device_arena import Buffer, buffers_nbytes
from openinfer_kernels.quant.fp8_ref import GROUP
from openinfer_kernels.quant.ops import GEMV_MAX_M, QuantOps
from openinfer_kernels.raw_cuda import kernel


@dataclass(frozen=True, eq=False)
class Fp8Device:
    """A kept FP8 weight on the device: codes uint8 (e4m3 bits) [N, K]; scale float32 (gemv_fp8's: block
    [ceil(N/128), K/128] or channel [N]); block_scale float32 [ceil(N/128), K/128] (the CuTe GEMM's: ones for a
    channel-scaled weight, whose row scales follow the product)."""
    codes: object
    scale: object
    block_scale: object
    channel: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def data(self):
        """The codes' memory (the dense ops compare weight addresses with the lm_head's)."""
        return self.codes.data


def fp8_host_arrays(w: Fp8Linear | Fp8Experts, interleave: bool) -> dict[str, np.ndarray]:
    """codes / scale (and a linear's block_scale) as uploaded; interleave: a channel-scaled gate_up's rows (and
    scales) in blocks of 8 gate / 8 up rows (each expert's)."""
    codes, scale = np.asarray(w.codes).view(np.uint8), w.scale
    if interleave:
        if not w.channel:
            raise ValueError("block-scaled gate_up weights are not interleaved")
        codes, scale = interleave_gate_up(codes), interleave_gate_up(scale[..., None])[..., 0]
    out = {"codes": np.ascontiguousarray(codes), "scale": np.ascontiguousarray(scale)}
    if isinstance(w, Fp8Linear):
        N, K = w.shape
        out["block_scale"] = np.ascontiguousarray(np.ones((-(-N // GROUP), K // GROUP), np.float32)
                                                  if w.channel else scale)
    return out


def upload_fp8_parts(arena, name: str, w: Fp8Linear | Fp8Experts, stream, interleave: bool) -> dict:
    """One kept FP8 weight's arrays (fp8_host_arrays) into the arena, queued on stream: the device arrays by part."""
    dev = {}
    for part, a in fp8_host_arrays(w, interleave).items():
        dev[part] = arena.take(f"weights.{name}.{part}", a.shape, a.dtype)
        dev[part].set(a, stream=stream)
    return dev


def upload_fp8(arena, weights: dict, stream, interleave) -> dict[str, Fp8Device]:
    """The kept FP8 weights into the arena (interleave(name): gate_up rows interleaved)."""
    out = {}
    for name, w in weights.items():
        dev = upload_fp8_parts(arena, name, w, stream, interleave(name))
        out[name] = Fp8Device(dev["codes"], dev["scale"], dev["block_scale"], w.channel)
    stream.synchronize()
    return out


class GpuFp8Linear:
    """ops.fp8: run(x, w, out, epi, res, norm_w, eps) = the W8A8 product of x (bf16 [T, K], RMSNorm'd by norm_w
    first where given) and an Fp8Device into out with an epilogue ("bf16", "residual": out = bf16(y) + res,
    "silu": out [T, N/2] = SiLU(gate)·up)."""

    quant_ops_class = QuantOps      # the quantized kernels' launches (the tests run a host emulation of them)

    def __init__(self, plan, shared, arena):
        self.shared = shared
        b = arena.take_all("fp8", self.buffers(plan))
        self.xq, self.xs = b["xq"], b["xs"]
        self.kernels = self.quant_ops_class(shared.stream)
        self.k_silu = self._kernel("silu_mul", "silu_mul")
        self.k_add = self._kernel("add_bias", "residual_add")
        self._row_scale = self._row_scale_kernel() if shared.gemm.cute is not None else None

    def _kernel(self, name: str, entry: str):
        return kernel(name, entry)

    @staticmethod
    def buffers(plan) -> list[Buffer]:
        """The quantized activations (e4m3 [T, K]) and their scales ([K/128, T]) of the widest K."""
        K = max([k for _, k in plan.linear_shapes] + [GROUP])
        rows = plan.max_tokens
        return [Buffer("xq", (rows * K,), np.uint8), Buffer("xs", (rows * K // GROUP,), np.float32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.buffers(plan))

    def quantize(self, x, norm_w=None, eps: float = 0.0):
        """(e4m3 [T, K], scales [K/128, T]) of x, or of rmsnorm(x) · norm_w."""
        T, K = x.shape
        q, s = self.xq[:T * K].reshape(T, K), self.xs[:T * K // GROUP].reshape(K // GROUP, T)
        self.kernels.pdl = self.shared.pdl
        self.kernels.fp8_quant(x, q, s, norm_w=norm_w, eps=eps)
        return q, s

    def run(self, x, w: Fp8Device, out, epi: str = "bf16", res=None, norm_w=None, eps: float = 0.0) -> None:
        T = x.shape[0]
        if epi == "silu" and not self.shared.gate_up_interleaved:        # block-scaled gate_up: not interleaved
            y = self.shared.out(T, w.shape[0])
            self.run(x, w, y, "bf16", None, norm_w, eps)
            self._silu(y, out)
        elif T <= GEMV_MAX_M:
            self._gemv(x, w, out, epi, res, norm_w, eps)
        elif self.shared.gemm.cute is not None:
            self._gemm(x, w, out, epi, res, norm_w, eps)
        else:                       # no CuTe library: the GEMV, GEMV_MAX_M rows at a time
            for r in range(0, T, GEMV_MAX_M):
                rows = slice(r, min(T, r + GEMV_MAX_M))
                self._gemv(x[rows], w, out[rows], epi, None if res is None else res[rows], norm_w, eps)

    def _gemv(self, x, w: Fp8Device, out, epi, res, norm_w, eps) -> None:
        q, s = self.quantize(x, norm_w, eps)
        self.kernels.gemv_fp8(q, s, w.codes, w.scale, out, epi, res)

    def _gemm(self, x, w: Fp8Device, out, epi, res, norm_w, eps) -> None:
        from openinfer_kernels import cute
        q, s = self.quantize(x, norm_w, eps)
        T, N = x.shape[0], w.shape[0]
        y = out if epi == "bf16" else self.shared.out(T, N)
        cute.fp8_gemm(q, s, w.codes, w.block_scale, y, self.shared.stream, prefetch_weights=True)
        if w.channel:
            self._scale_rows(y, w.scale)
        if epi == "silu":
            self._silu(y, out)
        elif epi == "residual":
            self.shared.launch(self.k_add, (max(1, min(4096, -(-T * N // 8 // 256))),), (256,),
                               (y, res, out, np.int64(T * N // 8)))

    def _silu(self, gate_up, out) -> None:
        T, two_i = gate_up.shape
        total = T * two_i // 2 // 8
        self.shared.launch(self.k_silu, (max(1, min(4096, -(-total // 256))),), (256,),
                           (gate_up, out, np.int32(two_i // 2), np.int64(total),
                            np.int32(self.shared.gate_up_interleaved)))

    @staticmethod
    def _row_scale_kernel():
        """y[t, n] = bf16(y[t, n] · s[n]) in place, compiled and loaded here (before any graph capture)."""
        import cupy
        k = cupy.ElementwiseKernel(
            "float32 s", "uint16 y",
            "float v = __uint_as_float(((unsigned int)y) << 16) * s;"
            "unsigned int u = __float_as_uint(v); u += 0x7FFFu + ((u >> 16) & 1u); y = (unsigned short)(u >> 16);",
            "fp8_channel_scale")
        k(cupy.ones(1, np.float32), cupy.zeros(1, np.uint16))
        return k

    def _scale_rows(self, y, scale) -> None:
        """A channel-scaled weight's product on the CuTe GEMM times its row scales (one more bf16 rounding)."""
        with self.shared.stream:
            self._row_scale(scale, y)
