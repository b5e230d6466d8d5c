"""Host launches of the quantized-weight raw CUDA kernels on one stream (CuPy arrays; bf16 as uint16, e4m3 as
uint8): the W4A16 GEMV (gemv_w4.cu, dense and grouped) and the 4-bit weights' bf16 for prefill (w4_dequant.cu),
the 4-bit experts' prefill GEMM (w4_grouped_gemm.cu), the FP8 activation quantization (fp8_quant.cu, alone
and after the RMSNorm), the W8A8 GEMV (gemv_fp8.cu, dense and grouped) and the FP8 experts' prefill GEMM
(fp8_grouped_gemm.cu). Each call checks its shapes and
raises ValueError before launching; ``_kernel`` / ``_launch`` are the two places that touch CUDA (the tests
run these same launches through a host emulation of the kernels). The prefill FP8 GEMM is the CuTe one
(openinfer_kernels/cute/gemm.py ``fp8_gemm``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .fp8_ref import GROUP
from .w4_layout import W4Packed

GEMV_MAX_M = 16                     # two n8 tiles
GEMV_THREADS = 256
WG_ROWS, WG_COLS, WG_THREADS = 64, 128, 128   # the grouped GEMMs' CTA (w4_ / fp8_grouped_gemm.cu): rows x weight rows
EPILOGUES = {"bf16": 0, "f32": 1, "residual": 2, "silu": 3}   # gemv_cta.cuh GEMV_EPI_*


@dataclass(frozen=True)
class W4Weight:
    """A W4Packed on the device (any array type), with what the kernel needs of it."""

    codes: object
    scales: object
    zeros: object | None
    n: int
    k: int
    group: int
    defines: tuple[tuple[str, int], ...]
    experts: int = 1

    @classmethod
    def upload(cls, packed: W4Packed, to_device=None) -> "W4Weight":
        """``to_device``: numpy -> device array (cupy.asarray by default)."""
        if to_device is None:
            import cupy
            to_device = cupy.asarray
        lead = packed.codes.shape[:-5]
        return cls(to_device(packed.codes), to_device(packed.scales),
                   None if packed.zeros is None else to_device(packed.zeros), packed.n, packed.k, packed.group,
                   tuple(sorted(packed.defines.items())), int(np.prod(lead)) if lead else 1)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class GemvConfig:
    """A decode GEMV's compile-time CTA shape (gemv_w4.cu W4_RT / W4_U, gemv_fp8.cu FP8_RT / FP8_U): 16-row
    tiles a CTA (dividing its 8 warps) and k steps (gemv_w4: 128-wide, gemv_fp8: 128-blocks) in each warp's
    batch of weight loads."""

    tiles_per_cta: int = 1
    steps_in_flight: int = 2

    def __post_init__(self):
        _check(self.tiles_per_cta in (1, 2, 4, 8), f"GEMV tiles a CTA: 1, 2, 4 or 8, got {self.tiles_per_cta}")
        _check(1 <= self.steps_in_flight <= 8, f"GEMV steps in flight: 1..8, got {self.steps_in_flight}")

    def defines(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_RT": self.tiles_per_cta, f"{prefix}_U": self.steps_in_flight}


W4_GEMV = GemvConfig(1, 2)          # measured best on Qwen3-8B's shapes (bench/results/quant-kernels.md)
FP8_GEMV = GemvConfig(2, 2)


def _rows(a, cols: int | None, what: str, dtype=np.uint16) -> int:
    """a's row count, after checking that it is a C-contiguous dtype [rows, cols] (cols None: any)."""
    _check(a.ndim == 2 and (cols is None or a.shape[1] == cols) and a.dtype == dtype and a.flags.c_contiguous,
           f"{what} must be a C-contiguous {np.dtype(dtype).name} [rows, {cols or 'K'}], got {a.dtype} {a.shape}")
    return a.shape[0]


def _check_gemm_tiles(rows: int, tile_m: int, tile_expert, row_token) -> None:
    """The grouped GEMMs' layout: tiles of tile_m rows (a multiple of their WG_ROWS-row blocks), a tile's expert and
    each row's token."""
    _check(tile_m % WG_ROWS == 0 and rows % tile_m == 0 and tile_expert.shape == (rows // tile_m,)
           and row_token.shape == (rows,), f"{rows} rows in tiles of {tile_m} (a multiple of {WG_ROWS}): "
           f"tile_expert [{rows // tile_m}] and row_token [{rows}] expected")


def _epilogue(epi: str, y, m: int, n: int, res) -> int:
    _check(epi in EPILOGUES, f"epilogue {epi!r}: one of {sorted(EPILOGUES)}")
    cols = n // 2 if epi == "silu" else n
    _rows(y, cols, "y", np.float32 if epi == "f32" else np.uint16)
    _check(y.shape[0] == m, f"y has {y.shape[0]} rows, x {m}")
    _check(epi != "silu" or n % 16 == 0, f"silu: N = {n} must interleave whole blocks of 8 gate and 8 up rows")
    _check((epi == "residual") == (res is not None), "a residual is given exactly with the residual epilogue")
    if res is not None:
        _check(res.shape == (m, n) and res.dtype == np.uint16, f"residual must be bf16 [{m}, {n}]")
    return EPILOGUES[epi]


class QuantOps:
    """The quantized-weight kernels' launches on ``stream`` (programmatic dependent launches where ``pdl``)."""

    pdl = True

    def __init__(self, stream=None, w4: GemvConfig = W4_GEMV, fp8: GemvConfig = FP8_GEMV):
        self.stream = stream
        self.w4, self.fp8 = w4, fp8

    def _kernel(self, name: str, entry: str, **defines: int):
        from openinfer_kernels.raw_cuda import kernel
        return kernel(name, entry, **defines)

    def _launch(self, k, grid, block, args) -> None:
        from openinfer_kernels.raw_cuda.launch import launch
        launch(k, grid, block, args, self.stream, pdl=self.pdl)

    def gemv_w4(self, x, w: W4Weight, y, epi: str = "bf16", res=None) -> None:
        """y = x · Wᵀ (x bf16 [M <= 16, K]) with an epilogue: "bf16", "f32" (y float32), "residual" (y =
        bf16(bf16(x · Wᵀ) + res), res may be y) or "silu" (y [M, N/2], W's rows gate / up interleaved by 8)."""
        m = _rows(x, w.k, "x")
        _check(1 <= m <= GEMV_MAX_M, f"gemv_w4 serves 1..{GEMV_MAX_M} rows, got {m}")
        _check(w.experts == 1, "gemv_w4 takes one weight; experts go through gemv_w4_grouped")
        _check(w.k < 1 << 21, f"gemv_w4 takes K < 2^21, got {w.k}")         # its group index's multiply-high
        code = _epilogue(epi, y, m, w.n, res)
        k = self._kernel("gemv_w4", f"gemv_w4_n{_ceil(m, 8)}", **dict(w.defines), **self.w4.defines("W4"))
        null = np.uint64(0)
        self._launch(k, (_ceil(_ceil(w.n, 16), self.w4.tiles_per_cta),), (GEMV_THREADS,),
                     (x, w.codes, w.scales, null if w.zeros is None else w.zeros, y, np.int32(m), np.int32(w.n),
                      np.int32(w.k), np.int32(w.group), null if res is None else res, np.int32(code)))

    def gemv_w4_grouped(self, a, w: W4Weight, tile_expert, row_token, out, tile_m: int) -> None:
        """out[r] = bf16(a[r] · W[tile_expert[r / tile_m]]ᵀ) for the rows with row_token >= 0 (moe_align's
        expert-grouped rows; W the experts stacked)."""
        rows = _rows(a, w.k, "a")
        _check(rows % tile_m == 0 and tile_expert.shape == (rows // tile_m,) and row_token.shape == (rows,),
               f"{rows} rows in tiles of {tile_m}: tile_expert [{rows // tile_m}] and row_token [{rows}] expected")
        _rows(out, w.n, "out")
        _check(w.k < 1 << 21, f"gemv_w4_grouped takes K < 2^21, got {w.k}")
        k = self._kernel("gemv_w4", "gemv_w4_grouped", **dict(w.defines), **self.w4.defines("W4"))
        self._launch(k, (_ceil(_ceil(w.n, 16), self.w4.tiles_per_cta), rows // tile_m), (GEMV_THREADS,),
                     (a, w.codes, w.scales, np.uint64(0) if w.zeros is None else w.zeros, tile_expert, row_token, out,
                      np.int32(w.n), np.int32(w.k), np.int32(w.group), np.int32(tile_m)))

    def w4_grouped_gemm(self, a, w: W4Weight, tile_expert, row_token, out, tile_m: int) -> None:
        """gemv_w4_grouped's product for prefill (w4_grouped_gemm.cu): CTAs of 64 rows x 128 weight rows, each
        weight dequantized once for 64 rows; tile_m a multiple of 64."""
        rows = _rows(a, w.k, "a")
        _check_gemm_tiles(rows, tile_m, tile_expert, row_token)
        _rows(out, w.n, "out")
        _check(w.k < 1 << 21, f"w4_grouped_gemm takes K < 2^21, got {w.k}")
        k = self._kernel("w4_grouped_gemm", "w4_grouped_gemm", **dict(w.defines))
        self._launch(k, (_ceil(w.n, WG_COLS), rows // WG_ROWS), (WG_THREADS,),
                     (a, w.codes, w.scales, np.uint64(0) if w.zeros is None else w.zeros, tile_expert, row_token, out,
                      np.int32(w.n), np.int32(w.k), np.int32(w.group), np.int32(tile_m)))

    def dequant_w4(self, w: W4Weight, out) -> None:
        """out = the bf16 weights (bf16 [E, N, ld] or [N, ld], ld >= K a multiple of 8) for the products the
        GEMV does not take: the prefill runs the bf16 GEMM on them (w4_dequant.cu)."""
        shape = (w.n, out.shape[-1]) if w.experts == 1 and out.ndim == 2 else (w.experts, w.n, out.shape[-1])
        _check(out.shape == shape and out.dtype == np.uint16 and out.flags.c_contiguous and out.shape[-1] >= w.k
               and out.shape[-1] % 8 == 0, f"out must be a C-contiguous bf16 [{'E, ' if w.experts > 1 else ''}"
               f"{w.n}, >= {w.k}] (a multiple of 8), got {out.dtype} {out.shape}")
        pieces = _ceil(w.n, 16) * _ceil(w.k, 128) * 64
        self._launch(self._kernel("w4_dequant", "w4_dequant", **dict(w.defines)), (_ceil(pieces, 256), w.experts),
                     (256,), (w.codes, w.scales, np.uint64(0) if w.zeros is None else w.zeros, out, np.int32(w.n),
                              np.int32(w.k), np.int32(w.group), np.int32(out.shape[-1])))

    def fp8_quant(self, x, q, scales, norm_w=None, residual=None, resid_out=None, eps: float = 0.0) -> None:
        """q (e4m3 [M, K]) and scales (float32 [K / 128, ld], ld >= M) of x (bf16 [M, K]); with ``norm_w``, of
        the RMSNorm of r = x (+ residual, written to resid_out) first (rms_norm.cu's rounding)."""
        m = _rows(x, None, "x")
        K = x.shape[1]
        _check(K % GROUP == 0, f"K = {K} must be a multiple of {GROUP}")
        _rows(q, K, "q", np.uint8)
        _check(q.shape[0] == m and scales.ndim == 2 and scales.shape[0] == K // GROUP and scales.shape[1] >= m
               and scales.dtype == np.float32 and scales.flags.c_contiguous,
               f"scales must be float32 [{K // GROUP}, >= {m}], got {scales.dtype} {scales.shape}")
        threads = min(1024, _ceil(K // 8, 32) * 32)
        if norm_w is None:
            _check(residual is None, "a residual needs the RMSNorm (norm_w)")
            self._launch(self._kernel("fp8_quant", "fp8_quant"), (m,), (threads,),
                         (x, q, scales, np.int32(K), np.int32(scales.shape[1])))
            return
        _check((residual is None) == (resid_out is None), "residual and resid_out come together")
        null = np.uint64(0)
        self._launch(self._kernel("fp8_quant", "rms_norm_residual_fp8_quant"), (m,), (threads,),
                     (x, null if residual is None else residual, norm_w, null if resid_out is None else resid_out, q,
                      scales, np.int32(K), np.int32(scales.shape[1]), np.float32(eps)))

    def gemv_fp8(self, xq, x_scales, w, w_scales, y, epi: str = "bf16", res=None) -> None:
        """y = the W8A8 product of xq (e4m3 [M <= 16, K], scales [K/128, ld]) and w (e4m3 [N, K]) with w_scales
        float32 [ceil(N/128), K/128] (blocks) or [N] (channels); epilogues as gemv_w4."""
        m = _rows(xq, None, "xq", np.uint8)
        n = _rows(w, xq.shape[1], "w", np.uint8)
        K = xq.shape[1]
        _check(1 <= m <= GEMV_MAX_M and K % GROUP == 0, f"gemv_fp8 serves 1..{GEMV_MAX_M} rows and K % {GROUP} == 0")
        channel = self._check_fp8_scales(w_scales, n, K)
        code = _epilogue(epi, y, m, n, res)
        _check(x_scales.shape[0] == K // GROUP and x_scales.shape[1] >= m, f"x_scales must be [{K // GROUP}, >= {m}]")
        k = self._kernel("gemv_fp8", f"gemv_fp8_n{_ceil(m, 8)}", FP8_CHANNEL=int(channel), **self.fp8.defines("FP8"))
        self._launch(k, (_ceil(_ceil(n, 16), self.fp8.tiles_per_cta),), (GEMV_THREADS,),
                     (xq, x_scales, np.int32(x_scales.shape[1]), w, w_scales, y, np.int32(m), np.int32(n), np.int32(K),
                      np.uint64(0) if res is None else res, np.int32(code)))

    def gemv_fp8_grouped(self, aq, a_scales, w, w_scales, tile_expert, row_token, out, tile_m: int) -> None:
        """Grouped W8A8 decode experts (as gemv_w4_grouped): w e4m3 [E, N, K], w_scales [E, ...] per expert."""
        rows, K = aq.shape
        n, channel = self._check_fp8_experts(w, w_scales, K)
        _check(rows % tile_m == 0 and tile_expert.shape == (rows // tile_m,),
               "tile_expert per tile of tile_m rows expected")
        _rows(out, n, "out")
        k = self._kernel("gemv_fp8", "gemv_fp8_grouped", FP8_CHANNEL=int(channel), **self.fp8.defines("FP8"))
        self._launch(k, (_ceil(_ceil(n, 16), self.fp8.tiles_per_cta), rows // tile_m), (GEMV_THREADS,),
                     (aq, a_scales, np.int32(a_scales.shape[1]), w, w_scales, tile_expert, row_token, out,
                      np.int32(n), np.int32(K), np.int32(tile_m)))

    def fp8_grouped_gemm(self, aq, a_scales, w, w_scales, tile_expert, row_token, out, tile_m: int) -> None:
        """gemv_fp8_grouped's product for prefill (fp8_grouped_gemm.cu): CTAs of 64 rows x 128 weight rows, each
        weight block read once for 64 rows; tile_m a multiple of 64, a_scales' rows a multiple of 4."""
        rows, K = aq.shape
        _check(K % GROUP == 0, f"K = {K} must be a multiple of {GROUP}")
        n, channel = self._check_fp8_experts(w, w_scales, K)
        _check_gemm_tiles(rows, tile_m, tile_expert, row_token)
        ldx = a_scales.shape[1]
        _check(a_scales.shape[0] == K // GROUP and ldx >= rows and ldx % 4 == 0,
               f"a_scales must be [{K // GROUP}, >= {rows}] with a multiple of 4 columns, got {a_scales.shape}")
        _rows(out, n, "out")
        k = self._kernel("fp8_grouped_gemm", "fp8_grouped_gemm", FP8_CHANNEL=int(channel))
        self._launch(k, (_ceil(n, WG_COLS), rows // WG_ROWS), (WG_THREADS,),
                     (aq, a_scales, np.int32(ldx), w, w_scales, tile_expert, row_token, out, np.int32(n), np.int32(K),
                      np.int32(tile_m)))

    @classmethod
    def _check_fp8_experts(cls, w, w_scales, k: int) -> tuple[int, bool]:
        """(N, channel scales) of FP8 experts w e4m3 [E, N, k] with w_scales per expert; ValueError otherwise."""
        _check(w.ndim == 3 and w.shape[2] == k and w.dtype == np.uint8, f"w must be e4m3 [E, N, {k}]")
        E, n = w.shape[:2]
        channel = cls._check_fp8_scales(w_scales[0], n, k)
        _check(w_scales.shape[0] == E, f"w_scales per expert expected: {E}, got {w_scales.shape[0]}")
        return n, channel

    @staticmethod
    def _check_fp8_scales(ws, n: int, k: int) -> bool:
        """True for channel scales [N], False for block scales [ceil(N/128), K/128]; ValueError otherwise."""
        if ws.shape == (n,) and ws.dtype == np.float32:
            return True
        _check(ws.shape == (_ceil(n, GROUP), k // GROUP) and ws.dtype == np.float32,
               f"weight scales must be float32 [{n}] or [{_ceil(n, GROUP)}, {k // GROUP}], got {ws.dtype} {ws.shape}")
        return False
