"""``gemm(a, b, out)``: ``out[M, N] = bf16(a[M, K] · b[N, K]ᵀ)`` with fp32 accumulation, on the GPU.

Arguments are device tensors: CuPy arrays (bf16 stored as ``uint16``) or ``DeviceTensor`` for raw
addresses. Rows must be contiguous, row strides and base addresses 16-byte aligned, and N, K
multiples of 8 (TMA needs 16-byte global strides); M is free. The config comes from
``configs.plan_gemm``; small M streams the weights in one row of 64-row (M <= 64) or 128-row
(M <= 128) tiles, about one CTA per SM, some split in K into a float32 workspace and a reduction
kernel, some in K pairs that sum over distributed shared memory (``prefetch_weights`` lets a
stream load its first weight tiles while the kernel before it finishes). The launch is
stream-ordered and CUDA-graph capturable once ``init()`` ran and, for split-K shapes,
``reserve_workspace`` covered the largest ``splits·M·N`` of the shapes (both happen outside capture).
The ``(rows, K, 1)`` / ``(M, N, S)`` tensor views match the fake tensors of ``build._fake_args``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from .configs import (FP8_VARIANTS_BY_NAME, REDUCE_NAME, REDUCE_RESIDUAL_NAME, VARIANTS_BY_NAME, GemmPlan,
                      GemmVariant, plan_fp8_gemm, plan_gemm, silu_twin, split_count, takes_weight_prefetch)
from .library import Library, TensorArg, open_library

BF16_TYPESTRS = ("<u2", "|u2", "bfloat16", "<V2")


@dataclass(frozen=True)
class DeviceTensor:
    """A raw device buffer: address, shape and strides in elements, element type string."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str = "bfloat16"  # or "float32"
    nbytes: int = 0
    readable: int = 0  # bytes readable from ptr on (the allocation's end); 0: unknown, only nbytes


def as_device_tensor(x, what: str, reach: bool = False) -> DeviceTensor:
    """Normalise a CuPy array (anything with ``__cuda_array_interface__``) or DeviceTensor;
    ``reach``: also find how far its allocation reaches (``readable``, for GEMM operand A)."""
    if isinstance(x, DeviceTensor):
        return x
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError(f"{what} must be a device array (CuPy) or DeviceTensor, got {type(x).__name__}")
    shape = tuple(iface["shape"])
    itemsize = int(iface["typestr"][2:]) if iface["typestr"][2:].isdigit() else 2
    strides = iface.get("strides")
    if strides is None:  # C-contiguous
        strides, acc = [], 1
        for dim in reversed(shape):
            strides.insert(0, acc)
            acc *= dim
    else:
        if any(s % itemsize for s in strides):
            raise ValueError(f"{what} has strides {strides} that are not whole elements")
        strides = [s // itemsize for s in strides]
    typestr = iface["typestr"]
    dtype = "bfloat16" if typestr in BF16_TYPESTRS else {"<f4": "float32", "<i4": "int32"}.get(typestr, typestr)
    size = 1
    for dim in shape:
        size *= dim
    ptr = int(iface["data"][0])
    return DeviceTensor(ptr, shape, tuple(strides), dtype, size * itemsize, _readable_bytes(x, ptr) if reach else 0)


def _readable_bytes(x, ptr: int) -> int:
    """Bytes from ``ptr`` to the end of the CuPy allocation holding ``x`` (a view into a larger
    buffer reaches its end), or 0 where unknown."""
    mem = getattr(getattr(x, "data", None), "mem", None)
    base, size = getattr(mem, "ptr", 0), getattr(mem, "size", 0)
    return base + size - ptr if base and base <= ptr < base + size else 0


A_ROW_PAD = 256  # A's rows are read to the next multiple of this when its allocation holds them


def readable_rows(a: DeviceTensor, m: int, k: int, row_stride: int) -> int:
    """Rows of A the kernel may load: M, or up to the next multiple of A_ROW_PAD where A's allocation
    holds them. Tiles whose rows lie past M are then loaded whole: the TMA's zero fill of
    out-of-bounds rows was measured to slow the mainloop (H200, 2026-12-01: a K-split pair at
    4B.down M = 193 46.5 -> 32.0 µs, 8B.gate_up M = 1 58.1 -> 54.1 µs). The extra rows feed only
    output rows past M, which the TMA store clips."""
    if not a.readable:
        return m
    fit = (a.readable // 2 - k) // row_stride + 1  # rows whose k elements lie inside the allocation
    return max(m, min(-(-m // A_ROW_PAD) * A_ROW_PAD, fit))


def _check_matrix(t: DeviceTensor, what: str, rows: int, cols: int, dtype: str) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{what} must be {dtype} (bf16 as uint16 in CuPy), got {t.dtype}")
    if t.shape != (rows, cols):
        raise ValueError(f"{what} has shape {t.shape}, expected ({rows}, {cols})")
    if t.shape[1] > 1 and t.strides[1] != 1:
        raise ValueError(f"{what} rows must be contiguous (column stride 1), got strides {t.strides}")
    if t.shape[0] > 1 and t.strides[0] % 8:
        raise ValueError(f"{what} row stride {t.strides[0]} is not a multiple of 8 elements (16 bytes)")
    if t.ptr % 16:
        raise ValueError(f"{what} address {t.ptr:#x} is not 16-byte aligned")


def check_gemm_args(a: DeviceTensor, b: DeviceTensor, out: DeviceTensor | None = None) -> tuple[int, int, int]:
    """Validate shapes, dtypes and alignment (of ``out`` too where given); return (M, N, K)."""
    for t, what in ((a, "a"), (b, "b")) + (() if out is None else ((out, "out"),)):
        if len(t.shape) != 2:
            raise ValueError(f"{what} must be 2-D, got shape {t.shape}")
    (m, k), n = a.shape, b.shape[0]
    if m < 1 or n < 1:
        raise ValueError(f"empty GEMM: M={m}, N={n}")
    if k < 8 or k % 8:
        raise ValueError(f"K={k} must be a positive multiple of 8")
    if n % 8:
        raise ValueError(f"N={n} must be a multiple of 8")
    _check_matrix(a, "a", m, k, "bfloat16")
    _check_matrix(b, "b", n, k, "bfloat16")
    if out is not None:
        _check_matrix(out, "out", m, n, "bfloat16")
    return m, n, k


def check_plan_rows(plan: GemmPlan, m: int) -> None:
    """A variant that loads only A's first ``a_rows`` rows of its tile serves at most that many rows."""
    if plan.variant.a_rows and m > plan.variant.a_rows:
        raise ValueError(f"{plan.variant.name} serves at most {plan.variant.a_rows} rows, got M={m}")


def _row_stride(t: DeviceTensor) -> int:
    return t.strides[0] if t.shape[0] > 1 else max(8, -(-t.shape[1] // 8) * 8)


class GemmRunner:
    """Owns the library handle and the split-K workspace of one process."""

    def __init__(self, library: Library | None = None):
        self.library = library if library is not None else open_library()
        self._workspace = None  # CuPy float32 buffer, grown outside graph capture
        self._captured = []     # workspaces a captured graph may point into: kept alive once replaced

    def init(self) -> None:
        """Load every kernel module onto every visible device (call before graph capture)."""
        import cupy

        self.library.load(list(range(cupy.cuda.runtime.getDeviceCount())))

    def ensure_loaded(self) -> None:
        import cupy

        if not self.library.is_loaded(cupy.cuda.Device().id):
            self.init()

    def reserve_workspace(self, max_m: int, shapes: Iterable[tuple[int, int]], buffer=None) -> None:
        """Grow the split-K workspace for every product of at most ``max_m`` rows with these
        ``(N, K)`` weights (``split_workspace_bytes``); ``buffer``: a caller's device array (e.g. carved
        from its arena) of at least that many bytes, used instead of an allocation of the runner's."""
        need = split_workspace_bytes(max_m, shapes)
        if buffer is not None:
            if buffer.nbytes < need:
                raise ValueError(f"split-K workspace buffer of {buffer.nbytes} bytes; {need} needed")
            self._workspace = buffer          # the caller owns it (and keeps it alive while used)
            return
        self._ensure_workspace(need, capturing=False)

    def use_workspace(self, buffer) -> None:
        """Point split-K products at ``buffer`` (a caller's device array, sized by ``reserve_workspace``):
        several owners of one process (executors) each keep their own, switched before their launches."""
        if buffer is not None and self._workspace is not buffer:
            self._workspace = buffer

    def _ensure_workspace(self, nbytes: int, capturing: bool) -> int:
        import cupy

        if self._workspace is None or self._workspace.nbytes < nbytes:
            if capturing:
                raise RuntimeError(
                    f"split-K workspace of {nbytes} bytes needed during CUDA graph capture; call "
                    "openinfer_kernels.cute.reserve_workspace(max_m, shapes) before capturing")
            self._workspace = cupy.empty(max(nbytes, 1 << 20) // 4, dtype=cupy.float32)
        if capturing and (not self._captured or self._captured[-1] is not self._workspace):
            self._captured.append(self._workspace)  # a graph holds its address: never free it
        return self._workspace.data.ptr

    def __call__(self, a, b, out, stream=None, plan: GemmPlan | None = None, residual=None,
                 prefetch_weights: bool = False, a_rows: int | None = None) -> None:
        """``out = a · bᵀ`` (+ ``residual``, a bf16 [M, N] that may be ``out`` itself: added in fp32
        in the epilogue, or in the split-K reduction). The GEMM is a programmatic dependent launch;
        ``prefetch_weights``: ``b`` is not written by the kernel before it in the stream (model
        weights), so its first k-tiles may load while that kernel finishes (taken where
        ``configs.takes_weight_prefetch``: the weight streams, M <= 128). ``a_rows``: ``a``'s buffer
        holds that many rows (>= M) at its row stride, all readable (default: found from the CuPy
        allocation, ``readable_rows``)."""
        a, b, out = as_device_tensor(a, "a", reach=True), as_device_tensor(b, "b"), as_device_tensor(out, "out")
        m, n, k = check_gemm_args(a, b, out)
        if residual is not None:
            residual = as_device_tensor(residual, "residual")
            _check_matrix(residual, "residual", m, n, "bfloat16")
        plan = plan or plan_gemm(m, n, k, residual=residual is not None)
        check_plan_rows(plan, m)
        if residual is not None and plan.variant.out == "bf16" and not plan.variant.residual:
            plan = GemmPlan(VARIANTS_BY_NAME[replace(plan.variant, residual=True).name], plan.splits)
        stream_ptr = _stream_ptr(stream)
        a_arg, b_arg, b_early = self._operands(a, b, m, n, k, plan, a_rows, prefetch_weights)
        s, ldo = split_count(k, plan.splits), _row_stride(out)
        if s == 1 and plan.variant.out == "bf16":
            extra = () if residual is None else (
                TensorArg(residual.ptr, (m, n, 1), (_row_stride(residual), _row_stride(residual) * m)),)
            self.library[plan.variant.name](a_arg, b_arg, TensorArg(out.ptr, (m, n, 1), (ldo, ldo * m)), *extra,
                                            b_early, stream=stream_ptr)
            return
        partial = self._split_product(a_arg, b_arg, b_early, plan, m, n, s, stream_ptr)
        if residual is None:
            self.library[REDUCE_NAME](partial, TensorArg(out.ptr, (m, n), (ldo,)), stream=stream_ptr)
        else:
            self.library[REDUCE_RESIDUAL_NAME](partial, TensorArg(out.ptr, (m, n), (ldo,)),
                                               TensorArg(residual.ptr, (m, n), (_row_stride(residual),)),
                                               stream=stream_ptr)

    def partials(self, a, b, stream=None, residual: bool = False, prefetch_weights: bool = False,
                 a_rows: int | None = None) -> DeviceTensor | None:
        """Where the planned product ``a · bᵀ`` (with ``residual``: the plan of ``out += a · bᵀ``) is
        split in K: launch only its GEMM and return the float32 partial sums, ``[S, M, N]`` (the
        workspace: valid until the next split product), for a kernel of the caller's to reduce
        (e.g. with a residual add and the RMSNorm after it). None where the plan does not split
        (nothing launched: call the GemmRunner itself)."""
        a, b = as_device_tensor(a, "a", reach=True), as_device_tensor(b, "b")
        m, n, k = check_gemm_args(a, b)
        plan = plan_gemm(m, n, k, residual=residual)
        s = split_count(k, plan.splits)
        if s == 1 or plan.variant.out != "f32":
            return None
        a_arg, b_arg, b_early = self._operands(a, b, m, n, k, plan, a_rows, prefetch_weights)
        partial = self._split_product(a_arg, b_arg, b_early, plan, m, n, s, _stream_ptr(stream))
        return DeviceTensor(partial.data, (s, m, n), (m * n, n, 1), "float32", s * m * n * 4)

    def swiglu(self, a, b, out, stream=None, prefetch_weights: bool = False, a_rows: int | None = None,
               plan: GemmPlan | None = None) -> bool:
        """``out[M, N/2] = bf16(SiLU(gate))·up`` of the product ``a · bᵀ`` in the GEMM's epilogue, ``b``
        a gate_up weight with gate and up rows interleaved in blocks of 8 (``interleave_gate_up`` of
        the engine): one kernel where the product and silu_mul took two. Where the planned variant has
        a SiLU·up twin (``configs.silu_twin``) this launches it and returns True; else nothing is
        launched and it returns False (the caller runs the product and the activation apart).
        ``prefetch_weights``, ``a_rows`` and ``plan`` (the plain product's) as for ``__call__``."""
        a, b, out = as_device_tensor(a, "a", reach=True), as_device_tensor(b, "b"), as_device_tensor(out, "out")
        m, n, k = check_gemm_args(a, b)
        if n % 16:
            raise ValueError(f"N={n}: an interleaved gate_up weight has a multiple of 16 rows")
        _check_matrix(out, "out", m, n // 2, "bfloat16")
        plan = plan or plan_gemm(m, n, k)
        check_plan_rows(plan, m)
        twin = silu_twin(plan)
        if twin is None:
            return False
        a_arg, b_arg, b_early = self._operands(a, b, m, n, k, plan, a_rows, prefetch_weights)
        ldo = _row_stride(out)
        self.library[twin.name](a_arg, b_arg, TensorArg(out.ptr, (m, n // 2, 1), (ldo, ldo * m)), b_early,
                                stream=_stream_ptr(stream))
        return True

    def _operands(self, a: DeviceTensor, b: DeviceTensor, m: int, n: int, k: int, plan: GemmPlan,
                  a_rows: int | None, prefetch_weights: bool) -> tuple[TensorArg, TensorArg, int]:
        """A's and B's ``(rows, K, 1)`` views and the ``b_early`` flag of one launch."""
        if a_rows is not None and a_rows < m:
            raise ValueError(f"a_rows={a_rows} is less than M={m}")
        self.ensure_loaded()
        lda, ldb = _row_stride(a), _row_stride(b)
        a_rows = a_rows or readable_rows(a, m, k, lda)
        b_early = int(prefetch_weights and takes_weight_prefetch(plan.variant, m))
        return (TensorArg(a.ptr, (a_rows, k, 1), (lda, lda * a_rows)), TensorArg(b.ptr, (n, k, 1), (ldb, ldb * n)),
                b_early)

    def _split_product(self, a_arg: TensorArg, b_arg: TensorArg, b_early: int, plan: GemmPlan, m: int, n: int,
                       s: int, stream_ptr: int) -> TensorArg:
        """The split-K GEMM into the workspace: ``(M, N, S)`` float32 partial sums."""
        import cupy

        if plan.variant.out != "f32":
            raise ValueError(f"split-K needs a float32-output variant, got {plan.variant.name}")
        capturing = cupy.cuda.runtime.streamIsCapturing(stream_ptr) != 0
        partial = TensorArg(self._ensure_workspace(s * m * n * 4, capturing), (m, n, s), (n, m * n))
        self.library[plan.variant.name](a_arg, b_arg, partial, b_early, stream=stream_ptr)
        return partial


def split_workspace_bytes(max_m: int, shapes: Iterable[tuple[int, int]]) -> int:
    """The float32 partials the planned split-K GEMMs need at most, over M = 1 … ``max_m`` and these
    ``(N, K)`` weights: ``splits·M·N·4`` bytes of the largest split plan (unsplit plans need none)."""
    need = 0
    for n, k in set(shapes):
        for m in range(1, max_m + 1):
            splits = plan_gemm(m, n, k).splits
            if splits > 1:
                need = max(need, splits * m * n * 4)
    return need


def check_grouped_args(a: DeviceTensor, w: DeviceTensor, tile_expert: DeviceTensor,
                       out: DeviceTensor) -> tuple[int, int, int, int, int]:
    """Validate a grouped GEMM; return (M, N, K, experts, tile_m)."""
    if len(w.shape) != 3:
        raise ValueError(f"w must be [experts, N, K], got shape {w.shape}")
    experts, n, k = w.shape
    m, _, _ = check_gemm_args(a, DeviceTensor(w.ptr, (n, k), w.strides[1:], w.dtype), out)
    if experts > 1 and w.strides[0] % 8:
        raise ValueError(f"w expert stride {w.strides[0]} is not a multiple of 8 elements (16 bytes)")
    if tile_expert.dtype != "int32" or len(tile_expert.shape) != 1:
        raise TypeError(f"tile_expert must be a 1-D int32 array, got {tile_expert.dtype} {tile_expert.shape}")
    if tile_expert.shape[0] > 1 and tile_expert.strides[0] != 1:
        raise ValueError("tile_expert must be contiguous")
    tiles = tile_expert.shape[0]
    if tiles == 0 or m % tiles or m // tiles not in (64, 128):
        raise ValueError(f"a has {m} rows for {tiles} tiles; rows per tile must be 64 or 128 "
                         "(pad each expert group with moe.group_by_expert)")
    return m, n, k, experts, m // tiles


def grouped_gemm(runner: GemmRunner, a, w, tile_expert, out, stream=None, prefetch_weights: bool = False) -> None:
    """``out[r] = a[r] · w[tile_expert[r // tile_m]]ᵀ`` for every row r (MoE experts in one launch);
    ``prefetch_weights`` as for ``GemmRunner.__call__`` (the expert map is always read after the wait)."""
    a, w = as_device_tensor(a, "a"), as_device_tensor(w, "w")
    tile_expert, out = as_device_tensor(tile_expert, "tile_expert"), as_device_tensor(out, "out")
    m, n, k, experts, tile_m = check_grouped_args(a, w, tile_expert, out)
    runner.ensure_loaded()
    ldb = w.strides[1] if n > 1 else k
    runner.library[VARIANTS_BY_NAME[f"grouped_bf16_{tile_m}x128_c1x1"].name](
        TensorArg(a.ptr, (m, k, 1), (_row_stride(a), _row_stride(a) * m)),
        TensorArg(w.ptr, (n, k, experts), (ldb, w.strides[0] if experts > 1 else ldb * n)),
        TensorArg(out.ptr, (m, n, 1), (_row_stride(out), _row_stride(out) * m)),
        TensorArg(tile_expert.ptr, (tile_expert.shape[0],), ()),
        int(prefetch_weights), stream=_stream_ptr(stream))


FP8_BLOCK = 128


def check_fp8_args(a: DeviceTensor, a_scales: DeviceTensor, b: DeviceTensor, b_scales: DeviceTensor,
                   out: DeviceTensor) -> tuple[int, int, int]:
    """Validate a block-scaled FP8 GEMM; return (M, N, K)."""
    for t, what in ((a, "a"), (b, "b"), (a_scales, "a_scales"), (b_scales, "b_scales"), (out, "out")):
        if len(t.shape) != 2:
            raise ValueError(f"{what} must be 2-D, got shape {t.shape}")
    (m, k), n = a.shape, b.shape[0]
    if m < 1 or n < 1 or k < FP8_BLOCK or k % FP8_BLOCK or n % 16:
        raise ValueError(f"FP8 GEMM M={m}, N={n}, K={k}: K a positive multiple of {FP8_BLOCK}, N of 16")
    for t, what, rows in ((a, "a", m), (b, "b", n)):
        if t.dtype not in ("|u1", "<u1") or t.shape != (rows, k) or (k > 1 and t.strides[1] != 1) \
                or (rows > 1 and t.strides[0] % 16) or t.ptr % 16:
            raise ValueError(f"{what} must be e4m3 bytes (uint8) [{rows}, {k}], contiguous 16-byte-aligned rows; "
                             f"got {t.dtype} {t.shape} strides {t.strides}")
    kb = k // FP8_BLOCK
    if a_scales.dtype != "float32" or a_scales.shape[0] != kb or a_scales.shape[1] < m or a_scales.strides[1] != 1:
        raise ValueError(f"a_scales must be float32 [{kb}, >= {m}] (MN-major, fp8_quant.cu's), got "
                         f"{a_scales.dtype} {a_scales.shape}")
    if b_scales.dtype != "float32" or b_scales.shape != (-(-n // FP8_BLOCK), kb) or b_scales.strides[1] != 1:
        raise ValueError(f"b_scales must be float32 [{-(-n // FP8_BLOCK)}, {kb}], got {b_scales.dtype} {b_scales.shape}")
    _check_matrix(out, "out", m, n, "bfloat16")
    return m, n, k


def fp8_gemm(runner: GemmRunner, a, a_scales, b, b_scales, out, stream=None, prefetch_weights: bool = False,
             variant: GemmVariant | None = None) -> None:
    """``out[M, N] = bf16(sum_kb a_scales[kb, m] · b_scales[n // 128, kb] · (a · bᵀ over k-block kb))``: the
    block-scaled FP8 GEMM (gemm_sm90_fp8) of prefill. ``a``: e4m3 activations [M, K] (uint8 in CuPy) with
    their per-token 128-group scales ``a_scales`` float32 [K/128, ld >= M] (raw_cuda/fp8_quant.cu); ``b``:
    e4m3 weights [N, K] with ``b_scales`` float32 [ceil(N/128), K/128] (``weight_scale_inv``). K % 128 == 0,
    N % 16 == 0. ``variant``: one of ``configs.FP8_GEMM_VARIANTS`` (default ``plan_fp8_gemm``);
    ``prefetch_weights`` as for ``GemmRunner.__call__``."""
    a, b, out = as_device_tensor(a, "a"), as_device_tensor(b, "b"), as_device_tensor(out, "out")
    a_scales, b_scales = as_device_tensor(a_scales, "a_scales"), as_device_tensor(b_scales, "b_scales")
    m, n, k = check_fp8_args(a, a_scales, b, b_scales, out)
    variant = variant or plan_fp8_gemm(m, n, k)
    if variant.name not in FP8_VARIANTS_BY_NAME:
        raise ValueError(f"{variant.name} is not an FP8 GEMM variant")
    runner.ensure_loaded()
    lda, ldb, ldo = _row_stride(a), _row_stride(b), _row_stride(out)
    kb = k // FP8_BLOCK
    runner.library[variant.name](
        TensorArg(a.ptr, (m, k, 1), (lda, lda * m)), TensorArg(b.ptr, (n, k, 1), (ldb, ldb * n)),
        TensorArg(out.ptr, (m, n, 1), (ldo, ldo * m)), TensorArg(a_scales.ptr, (m, kb), (a_scales.strides[0],)),
        TensorArg(b_scales.ptr, (b_scales.shape[0], kb), (b_scales.strides[0] if b_scales.shape[0] > 1 else kb,)),
        int(prefetch_weights), stream=_stream_ptr(stream))


def _stream_ptr(stream) -> int:
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    ptr = getattr(stream, "ptr", None)
    if ptr is None:
        raise TypeError(f"stream must be None, an int handle or have .ptr, got {type(stream).__name__}")
    return int(ptr)
