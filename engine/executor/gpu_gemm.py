"""Linear layers on the GPU: y[T, N] = x[T, K] · w[N, K]ᵀ, bf16 operands, fp32 accumulation.

cuBLAS (cublasGemmEx, CUBLAS_COMPUTE_32F) is the default path and the yardstick. It is called
through ctypes on the same libcublas CuPy loads, on a handle of our own bound once to our stream
with a fixed workspace from the arena, so a captured CUDA graph allocates nothing (CuPy's own
wrappers rebind the handle to CuPy's current stream at every call, which also drops a user
workspace). Where that library cannot be opened, CuPy's wrapper serves, run with our stream
current. The CuTe DSL GEMM of openinfer_kernels/cute replaces cuBLAS for bf16 products of at most
``cute_max_m`` rows where it is built and reports itself available (``cute_rows``: the executor's
default "auto" gives it the decode-sized products, at most CUTE_AUTO_MAX_M rows); outputs are bf16
(hidden states) or fp32 (logits, always cuBLAS). With
`gemv_max_m > 0`, bf16 products of at most that many rows (decode) run the raw CUDA skinny GEMM of
openinfer_kernels/raw_cuda/gemv.cu instead (bandwidth-shaped: 16-byte weight loads, tensor-core mma), which
also has the decoder's RMSNorm prologue and residual-add epilogue fused in (`gemv`). The
fp32-output product (logits over the vocabulary) stays on cuBLAS: on the H200 (2026-11-30,
bench/results/decode.md) cuBLAS read the 151936x2560 lm_head at 0.93 of HBM roofline at M = 1 against
gemv.cu's 0.88, and the gap grows with M.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np

from engine.executor.gpu_device import DeviceInfo
from openinfer_kernels.raw_cuda import kernel
from openinfer_kernels.raw_cuda.launch import launch

CUDA_R_16BF = 14
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
GEMV_LIMIT_M = 32             # gemv.cu has n8 tiles 1..4
GEMV_VARIANTS = ("bf16", "f32", "norm", "res", "norm_silu", "silu")   # gemv.cu entry points gemv_<variant>_n<NT>
# GpuTuning.gemv_unroll / gemv_unroll_narrow: k steps per weight batch. H200, Qwen3-4B batch-1 graphed decode (2026-12-01): 2 -> 3.45 ms/step, 8 -> 4.95 (fewer registers,
# more resident CTAs beat deeper per-warp batches) -- for the wide products. A narrow one (fewer than
# two CTAs per SM: o_proj and down_proj, N = hidden) has too few CTAs to keep enough bytes in flight
# (Little's law: 160 CTAs x 16 KB at ~1 µs is ~2.6 TB/s), so it takes deeper batches.
DEFAULT_GEMV_UNROLL = 2
DEFAULT_GEMV_UNROLL_NARROW = 4
log = logging.getLogger(__name__)
# "auto": the CuTe GEMM for products of at most this many rows (decode batches), cuBLAS above
# (prefill). Graphed decode on the H200 (2026-12-01 21:17 UTC, bench/results/decode.md): Qwen3-8B
# batch 8 / 32 / 128 5.41 / 5.48 / 7.38 -> 5.06 / 5.14 / 7.07 ms per step; above 128 rows it is
# within 5% of cuBLAS on most shapes but up to 20% slower on a few (bench/results/kernels.md).
CUTE_AUTO_MAX_M = 128
ALL_ROWS = 1 << 30


def cute_rows(backend: str | bool) -> int:
    """The row limit of the CuTe GEMM for a backend choice (GpuTuning.gemm): "auto" CUTE_AUTO_MAX_M,
    "cute" (or True) every product, "cublas" (or False) none."""
    if isinstance(backend, bool):
        return ALL_ROWS if backend else 0
    rows = {"auto": CUTE_AUTO_MAX_M, "cute": ALL_ROWS, "cublas": 0}.get(str(backend).strip().lower())
    if rows is None:
        raise ValueError(f"GEMM backend {backend!r}: want auto, cute or cublas ($OPENINFER_GEMM)")
    return rows


def interleave_gate_up(w: np.ndarray) -> np.ndarray:
    """A fused [gate; up] weight [2I, H] (or stacked experts' [E, 2I, H]) with its rows reordered into
    blocks of 8 gate rows followed by the same 8 up rows (I % 8 == 0): the layout of gemv.cu's fused
    SiLU·up epilogue, whose CTAs own 16 rows, and of silu_mul.cu's interleaved mode."""
    *lead, two_i, h = w.shape
    if two_i % 16:
        raise ValueError(f"gate_up weight of {two_i} rows: interleaving needs a multiple of 16")
    blocks = w.reshape(*lead, 2, two_i // 16, 8, h)
    return np.ascontiguousarray(np.swapaxes(blocks, -4, -3).reshape(w.shape))


def row_stride(a) -> int:
    """A matrix's row stride in values (its width where it has one row or contiguous rows)."""
    return a.strides[0] // a.itemsize if a.shape[0] > 1 else a.shape[1]


def _direct_cublas():
    """libcublas through ctypes, or None."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    lib.cublasGemmEx.restype = i
    return lib


def cute_workspace_bytes(plan, cute_max_m: int) -> int:
    """The CuTe GEMM's split-K partials for every product of at most min(cute_max_m, max tokens) rows
    with the plan's linear weights (0 where the CuTe GEMM serves nothing)."""
    if cute_max_m <= 0:
        return 0
    from openinfer_kernels.cute.gemm import split_workspace_bytes

    return split_workspace_bytes(min(plan.max_tokens, cute_max_m), plan.linear_shapes)


class Gemm:
    """workspace: cuBLAS's (WORKSPACE_BYTES from the arena); cute_workspace: the CuTe GEMM's split-K
    partials (cute_workspace_bytes, from the arena; None: the CuTe runner allocates its own)."""

    def __init__(self, stream, workspace=None, cute_max_m: int = 0, gemv_max_m: int = 0,
                 gemv_unroll: tuple[int, int] = (DEFAULT_GEMV_UNROLL, DEFAULT_GEMV_UNROLL_NARROW),
                 num_sms: int | None = None, cute_workspace=None):
        self.stream = stream
        if not 0 <= gemv_max_m <= GEMV_LIMIT_M:
            raise ValueError(f"gemv_max_m must be in 0..{GEMV_LIMIT_M}, got {gemv_max_m}")
        self.gemv_max_m = gemv_max_m
        self._gemv: dict[tuple[int, str, int], object] = {}
        self.gemv_unroll = tuple(gemv_unroll)   # (wide, narrow) k steps per weight batch
        if num_sms is None:
            num_sms = DeviceInfo.query().num_sms
        self.num_sms = num_sms
        self.cute_workspace = cute_workspace
        self.rewritten: list[tuple[int, int]] = []      # device ranges a forward writes weights into (mark_rewritten)
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)
        self._beta_one = np.ones(1, np.float32)
        self.lib = _direct_cublas()
        if self.lib is not None:
            handle = ctypes.c_void_p()
            self._check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
            self.handle = handle.value
            self._check(self.lib.cublasSetStream_v2(ctypes.c_void_p(self.handle), ctypes.c_void_p(stream.ptr)),
                        "cublasSetStream")
            self._check(self.lib.cublasSetPointerMode_v2(ctypes.c_void_p(self.handle), 0), "cublasSetPointerMode")
            if workspace is not None:
                self._check(self.lib.cublasSetWorkspace_v2(ctypes.c_void_p(self.handle),
                                                           ctypes.c_void_p(workspace.data.ptr),
                                                           ctypes.c_size_t(workspace.nbytes)), "cublasSetWorkspace")
        else:
            from cupy_backends.cuda.libs import cublas
            self._cublas = cublas
            self.handle = cublas.create()
            cublas.setPointerMode(self.handle, 0)
        self.cute, self.cute_max_m, self.cute_missing = None, cute_max_m, ""
        if cute_max_m > 0:
            try:
                import openinfer_kernels.cute as cute
                ready = cute.available()
                self.cute, self.cute_missing = (cute, "") if ready else (None, ready.reason)
            except Exception as exc:   # the AOT library is optional: cuBLAS serves without it
                self.cute_missing = f"{type(exc).__name__}: {exc}"

    def describe(self) -> str:
        """Which library runs which products, for the startup log."""
        gemv = f"gemv.cu for 1-{self.gemv_max_m} rows, " if self.gemv_max_m else ""
        if self.cute is None:
            why = f" (CuTe GEMM not used: {self.cute_missing})" if self.cute_missing else ""
            return f"linear layers: {gemv}cuBLAS{why}"
        rows = "every product" if self.cute_max_m >= ALL_ROWS else f"at most {self.cute_max_m} rows"
        return f"linear layers: {gemv}CuTe GEMM for {rows}, cuBLAS otherwise"

    def prepare_cute(self, max_rows: int, shapes) -> None:
        """Before any graph capture: load the CuTe kernels onto the device, size their split-K
        workspace for every product of at most ``max_rows`` rows with these ``(N, K)`` weights,
        and check one small product, plain and accumulating, against float32 (``self_check``).
        A failure leaves cuBLAS serving, with a warning that says why (``describe``)."""
        if self.cute is None or not shapes:
            return
        try:
            self.cute.init()
            self.cute.reserve_workspace(min(max_rows, self.cute_max_m), sorted({tuple(s) for s in shapes}),
                                        buffer=self.cute_workspace)
            self.cute.self_check()
        except Exception as exc:
            self.cute, self.cute_missing = None, f"its start-up check failed: {type(exc).__name__}: {exc}"
            log.warning("CuTe GEMM off, cuBLAS serves every product: %s", self.cute_missing)

    def mark_rewritten(self, buffer) -> None:
        """Weights read from ``buffer`` are written by the kernel just before their product (a dequantized int4
        weight's scratch): those products load no weight tile before that kernel ends (no early loads, no PDL)."""
        self.rewritten.append((buffer.data.ptr, buffer.data.ptr + buffer.nbytes))

    def stable(self, w) -> bool:
        """Whether ``w`` is a model weight no kernel of the forward writes, so its tiles may load early."""
        return not any(lo <= w.data.ptr < hi for lo, hi in self.rewritten)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def __call__(self, x, w, out, pdl: bool = False, accumulate: bool = False, gemv_f32: bool = False) -> None:
        """x [T, K] bf16 (uint16 bits), w [N, K] bf16, out [T, N] bf16 (uint16) or float32; x and w may be
        views of wider rows (their row strides are read), out is contiguous.
        pdl: launch a gemv.cu kernel as a programmatic dependent launch (openinfer_kernels/raw_cuda/launch.py).
        accumulate: out += x · wᵀ, added in fp32 before the one rounding (cuBLAS beta = 1, or the CuTe
        GEMM's residual epilogue): the residual add of o_proj / down_proj with no kernel of its own.
        gemv_f32: a float32 out of decode rows on gemv.cu too (its f32 entries: DeepSeek-V4's projections);
        off, the logits' one wide product stays on cuBLAS (measured at the copy roofline)."""
        T, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K or out.shape != (T, N):
            raise ValueError(f"linear shapes: x {x.shape}, w {w.shape}, out {out.shape}")
        if not accumulate and self.gemv_serves(x, w, out, gemv_f32):
            self.gemv(x, w, out, pdl=pdl)
            return
        if self.cute_serves(T, out):
            # a model weight no forward writes: its first k-tiles may load while the kernel before finishes
            # (a chain of weight streams overlaps its launch gaps)
            self.cute.use_workspace(self.cute_workspace)
            self.cute.gemm(x, w, out, self.stream, residual=out if accumulate else None,
                           prefetch_weights=self.stable(w))
            return
        ctype = CUDA_R_32F if out.dtype == np.float32 else CUDA_R_16BF
        beta = self._beta_one if accumulate else self._beta
        # Column-major view: outᵀ [N, T] = w [K, N]ᵀ · xᵀ [K, T] (+ outᵀ).
        args = (CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, self._alpha.ctypes.data, w.data.ptr, CUDA_R_16BF, row_stride(w),
                x.data.ptr, CUDA_R_16BF, row_stride(x), beta.ctypes.data, out.data.ptr, ctype, N,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        if self.lib is not None:
            self._check(self.lib.cublasGemmEx(self.handle, *args), "cublasGemmEx")
        else:
            with self.stream:           # CuPy binds the handle to its current stream at each call
                self._cublas.gemmEx(self.handle, *args)

    def cute_partials(self, x, w, residual):
        """For ``residual += x · wᵀ`` on the CuTe GEMM where its plan splits in K: launch the split
        GEMM alone and return its float32 partials ``[S, T, N]`` (openinfer_kernels.cute.DeviceTensor) for a
        fused reduction; None where CuTe does not take the product or its plan does not split."""
        if not self.cute_serves(x.shape[0], residual):
            return None
        self.cute.use_workspace(self.cute_workspace)
        return self.cute.gemm_partials(x, w, self.stream, residual=True, prefetch_weights=self.stable(w))

    def cute_fuses_swiglu(self, rows: int, w) -> bool:
        """Whether the CuTe GEMM takes a gate_up product of ``rows`` rows with its SiLU·up in the
        epilogue (cute_swiglu): CuTe serves the rows and the planned tile has a SiLU·up twin."""
        if self.cute is None or rows > self.cute_max_m:
            return False
        from openinfer_kernels.cute.configs import plan_gemm, silu_twin
        return silu_twin(plan_gemm(rows, *w.shape)) is not None

    def cute_swiglu(self, x, w, out) -> None:
        """out [T, N/2] = SiLU(gate)·up of x · wᵀ in one CuTe GEMM, w a gate_up weight interleaved
        (interleave_gate_up); only where cute_fuses_swiglu."""
        self.cute.use_workspace(self.cute_workspace)
        if not self.cute.gemm_swiglu(x, w, out, self.stream, prefetch_weights=self.stable(w)):
            raise RuntimeError(f"no SiLU·up GEMM for {x.shape[0]} rows of {w.shape}: ask cute_fuses_swiglu first")

    def cute_serves(self, rows: int, out) -> bool:
        """Whether the CuTe GEMM takes a product: built and available, a bf16 output, at most
        cute_max_m rows."""
        return self.cute is not None and out.dtype == np.uint16 and rows <= self.cute_max_m

    def gemv_serves(self, x, w, out=None, f32: bool = False) -> bool:
        """Whether gemv.cu takes this product: at most gemv_max_m rows, 16-byte pieces of contiguous
        rows (K % 8 == 0, aligned; x C-contiguous, w's rows contiguous 16-byte-aligned rows of a row
        stride of its own), a bf16 output (out None: a fresh bf16 buffer), or with f32 a float32 one."""
        K = w.shape[1]
        dtypes = (np.uint16, np.float32) if f32 else (np.uint16,)
        return (x.shape[0] <= self.gemv_max_m and K % 8 == 0 and row_stride(w) % 8 == 0
                and (x.data.ptr | w.data.ptr) % 16 == 0 and x.flags.c_contiguous and w.strides[1] == w.itemsize
                and (out is None or (out.dtype in dtypes and out.flags.c_contiguous)))

    def gemv(self, x, w, out, variant: str = "", norm_w=None, res_in=None, eps: float = 0.0,
             pdl: bool = False) -> None:
        """out = x · wᵀ through gemv.cu, T <= 32 rows. variant "norm": x is RMSNorm'ed with norm_w, eps
        first; "res": out = bf16(x · wᵀ) + res_in; "norm_silu": "norm", then out [T, N/2] = SiLU(gate)·up
        of the product, w interleaved (interleave_gate_up); "silu": the same without the norm. "" picks "bf16" or "f32" from out's dtype."""
        T = x.shape[0]
        N, K = w.shape
        variant = variant or ("f32" if out.dtype == np.float32 else "bf16")
        if variant not in GEMV_VARIANTS or T > GEMV_LIMIT_M:
            raise ValueError(f"gemv: variant {variant!r} with {T} rows (want one of {GEMV_VARIANTS}, "
                             f"at most {GEMV_LIMIT_M} rows)")
        ctas = -(-N // 16)
        key = (-(-T // 8), variant, self.gemv_unroll[ctas < 2 * self.num_sms])
        if key not in self._gemv:
            self._gemv[key] = kernel("gemv", f"gemv_{variant}_n{key[0]}", GEMV_U=key[2])
        null = np.uint64(0)
        args = (x, w, out, np.int32(T), np.int32(N), np.int32(K), null if norm_w is None else norm_w,
                null if res_in is None else res_in, np.float32(eps), np.int32(row_stride(w)))
        # gemv.cu loads its first weight tiles before pdl_wait: only a stable weight may launch dependent
        launch(self._gemv[key], (ctas,), (256,), args, self.stream, pdl=pdl and self.stable(w))

    def strided_batched(self, op_a: int, m: int, n: int, k: int, a, a_off: int, lda: int, stride_a: int,
                        b, b_off: int, ldb: int, stride_b: int, c, ldc: int, stride_c: int, batch: int) -> None:
        """cuBLAS strided-batched GEMM, column-major: C_i [m, n] = op(A_i) · B_i for i < batch, A and B bf16
        (offsets and strides in values), C bf16 or float32 (from its dtype), fp32 accumulation (MLA's
        per-head absorptions, gpu_mla_ops.py)."""
        ctype = CUDA_R_32F if c.dtype == np.float32 else CUDA_R_16BF
        args = [op_a, CUBLAS_OP_N, m, n, k, self._alpha.ctypes.data, a.data.ptr + 2 * a_off, CUDA_R_16BF, lda,
                stride_a, b.data.ptr + 2 * b_off, CUDA_R_16BF, ldb, stride_b, self._beta.ctypes.data, c.data.ptr, ctype,
                ldc, stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT]
        if self.lib is None:
            with self.stream:           # CuPy binds the handle to its current stream at each call
                self._cublas.gemmStridedBatchedEx(self.handle, *args)
            return
        fn = self.lib.cublasGemmStridedBatchedEx
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        fn.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i]
        fn.restype = i
        self._check(fn(self.handle, *args), "cublasGemmStridedBatchedEx")

    def close(self) -> None:
        if self.handle:
            if self.lib is not None:
                self.lib.cublasDestroy_v2(ctypes.c_void_p(self.handle))
            else:
                self._cublas.destroy(self.handle)
            self.handle = 0
