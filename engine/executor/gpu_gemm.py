"""Linear layers on the GPU: y[T, N] = x[T, K] · w[N, K]ᵀ, bf16 operands, fp32 accumulation.

cuBLAS (gemmEx through CuPy, CUBLAS_COMPUTE_32F) is the default path and the yardstick: it is
graph-capturable with a fixed workspace and tuned for every shape we meet. The CuTe DSL GEMM of
kernels/cute replaces it where that library is built and reports itself available
(`use_cute=True`); the output may be bf16 (hidden states) or fp32 (logits).
"""
from __future__ import annotations

import numpy as np

CUDA_R_16BF = 14
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20


class Gemm:
    def __init__(self, stream, workspace=None, use_cute: bool = False):
        from cupy_backends.cuda.libs import cublas

        self._cublas = cublas
        self.handle = cublas.create()
        cublas.setStream(self.handle, stream.ptr)
        cublas.setPointerMode(self.handle, 0)               # alpha / beta on the host
        if workspace is not None and hasattr(cublas, "setWorkspace"):   # graph capture allocates nothing
            cublas.setWorkspace(self.handle, workspace.data.ptr, workspace.nbytes)
        self.stream = stream
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)
        self.cute = None
        if use_cute:
            try:
                import kernels.cute as cute
                self.cute = cute if cute.available() else None
            except Exception:   # the AOT library is optional: cuBLAS serves without it
                self.cute = None

    def __call__(self, x, w, out) -> None:
        """x [T, K] bf16 (uint16 bits), w [N, K] bf16, out [T, N] bf16 (uint16) or float32."""
        T, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K or out.shape != (T, N):
            raise ValueError(f"linear shapes: x {x.shape}, w {w.shape}, out {out.shape}")
        if self.cute is not None and out.dtype == np.uint16:
            self.cute.gemm(x, w, out, self.stream)
            return
        ctype = CUDA_R_32F if out.dtype == np.float32 else CUDA_R_16BF
        # CuPy's cuBLAS wrappers bind the handle to CuPy's *current* stream at every call, so the
        # GEMM must run with our stream current to stay ordered with the raw kernels.
        # Column-major view: outᵀ [N, T] = w [K, N]ᵀ · xᵀ [K, T].
        with self.stream:
            self._gemm(N, T, K, w, x, out, ctype)

    def _gemm(self, N, T, K, w, x, out, ctype) -> None:
        self._cublas.gemmEx(self.handle, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K,
                            self._alpha.ctypes.data, w.data.ptr, CUDA_R_16BF, K,
                            x.data.ptr, CUDA_R_16BF, K,
                            self._beta.ctypes.data, out.data.ptr, ctype, N,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)

    def close(self) -> None:
        if self.handle:
            self._cublas.destroy(self.handle)
            self.handle = 0
