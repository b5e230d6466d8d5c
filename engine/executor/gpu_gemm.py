"""Linear layers on the GPU: y[T, N] = x[T, K] · w[N, K]ᵀ, bf16 operands, fp32 accumulation.

cuBLAS (cublasGemmEx, CUBLAS_COMPUTE_32F) is the default path and the yardstick. It is called
through ctypes on the same libcublas CuPy loads, on a handle of our own bound once to our stream
with a fixed workspace from the arena, so a captured CUDA graph allocates nothing (CuPy's own
wrappers rebind the handle to CuPy's current stream at every call, which also drops a user
workspace). Where that library cannot be opened, CuPy's wrapper serves, run with our stream
current. The CuTe DSL GEMM of kernels/cute replaces cuBLAS where it is built and reports itself
available (`use_cute=True`); outputs are bf16 (hidden states) or fp32 (logits). With
`gemv_max_m > 0`, bf16 products of at most that many rows (decode) run the raw CUDA skinny GEMM of
kernels/raw_cuda/gemv.cu instead (bandwidth-shaped: 16-byte weight loads, tensor-core mma). The
fp32-output product (logits over the vocabulary) stays on cuBLAS: on the H200 (2026-11-30,
bench/results/decode.md) cuBLAS read the 151936x2560 lm_head at 0.93 of HBM roofline at M = 1 against
gemv.cu's 0.88, and the gap grows with M.
"""
from __future__ import annotations

import ctypes

import numpy as np

CUDA_R_16BF = 14
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
GEMV_LIMIT_M = 32             # gemv.cu has n8 tiles 1..4


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


class Gemm:
    def __init__(self, stream, workspace=None, use_cute: bool = False, gemv_max_m: int = 0):
        self.stream = stream
        if not 0 <= gemv_max_m <= GEMV_LIMIT_M:
            raise ValueError(f"gemv_max_m must be in 0..{GEMV_LIMIT_M}, got {gemv_max_m}")
        self.gemv_max_m = gemv_max_m
        self._gemv: dict[tuple[int, bool], object] = {}
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)
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
        self.cute = None
        if use_cute:
            try:
                import kernels.cute as cute
                self.cute = cute if cute.available() else None
            except Exception:   # the AOT library is optional: cuBLAS serves without it
                self.cute = None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def __call__(self, x, w, out) -> None:
        """x [T, K] bf16 (uint16 bits), w [N, K] bf16, out [T, N] bf16 (uint16) or float32."""
        T, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K or out.shape != (T, N):
            raise ValueError(f"linear shapes: x {x.shape}, w {w.shape}, out {out.shape}")
        if T <= self.gemv_max_m and out.dtype == np.uint16 and self._gemv_fits(x, w, out):
            self._run_gemv(x, w, out)
            return
        if self.cute is not None and out.dtype == np.uint16:
            self.cute.gemm(x, w, out, self.stream)
            return
        ctype = CUDA_R_32F if out.dtype == np.float32 else CUDA_R_16BF
        # Column-major view: outᵀ [N, T] = w [K, N]ᵀ · xᵀ [K, T].
        args = (CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, self._alpha.ctypes.data, w.data.ptr, CUDA_R_16BF, K,
                x.data.ptr, CUDA_R_16BF, K, self._beta.ctypes.data, out.data.ptr, ctype, N,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        if self.lib is not None:
            self._check(self.lib.cublasGemmEx(self.handle, *args), "cublasGemmEx")
        else:
            with self.stream:           # CuPy binds the handle to its current stream at each call
                self._cublas.gemmEx(self.handle, *args)

    @staticmethod
    def _gemv_fits(x, w, out) -> bool:
        """gemv.cu reads 16-byte pieces of contiguous rows: K % 8 == 0, aligned, C-contiguous."""
        K = x.shape[1]
        return (K % 8 == 0 and (x.data.ptr | w.data.ptr) % 16 == 0 and x.flags.c_contiguous
                and w.flags.c_contiguous and out.flags.c_contiguous)

    def _run_gemv(self, x, w, out) -> None:
        from kernels.raw_cuda import kernel

        T, K = x.shape
        N = w.shape[0]
        key = (-(-T // 8), out.dtype == np.float32)
        if key not in self._gemv:
            self._gemv[key] = kernel("gemv", f"gemv_{'f32' if key[1] else 'bf16'}_n{key[0]}")
        self._gemv[key]((-(-N // 16),), (256,), (x, w, out, np.int32(T), np.int32(N), np.int32(K)),
                        stream=self.stream)

    def close(self) -> None:
        if self.handle:
            if self.lib is not None:
                self.lib.cublasDestroy_v2(ctypes.c_void_p(self.handle))
            else:
                self._cublas.destroy(self.handle)
            self.handle = 0
