"""CuTe DSL kernels for Hopper, compiled ahead of time into one ``.so`` and launched through ctypes.

Build once per checkout (no GPU needed): ``python -m openinfer_kernels.cute.build``. At run time only the
``.so``, its manifest and CuPy are used::

    from openinfer_kernels import cute
    if cute.available():
        cute.init()                                  # load modules (before any graph capture)
        cute.gemm(a, w, out, stream=stream)          # out[M,N] = a[M,K] · w[N,K]ᵀ, bf16 as uint16
        cute.gemm(a, w, h, stream=stream, residual=h)  # h += a · wᵀ (residual add in the epilogue)
        cute.gemm_swiglu(x, w_gate_up, act, stream=stream)  # act = SiLU(gate)·up, w rows interleaved
        groups = cute.group_by_expert(topk_ids, num_experts, tile_m=64)   # MoE, host side
        cute.grouped_gemm(a_grouped, w_experts, tile_expert, out_grouped, stream=stream)
        work = cupy.asarray(cute.attention_work(cu_seqlens_q_host))          # host-built tile list
        cute.varlen_attention(q, k, v, o, cu_q, cu_k, work, stream=stream)
    else:
        print(cute.available().reason)

Validation status and H200 numbers: bench/results/kernels.md (``tests/kernels/test_cute_gpu.py`` must pass
on the GPU before the engine relies on a kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

from .attention import attention_work
from .attention import varlen_attention as _varlen_attention
from .gemm import DeviceTensor, GemmRunner
from .gemm import fp8_gemm as _fp8_gemm
from .gemm import grouped_gemm as _grouped_gemm
from .moe import ExpertGroups, group_by_expert

__all__ = ["available", "init", "gemm", "gemm_partials", "gemm_swiglu", "fp8_gemm", "grouped_gemm",
           "group_by_expert", "ExpertGroups",
           "varlen_attention", "attention_work", "reserve_workspace", "use_workspace", "DeviceTensor"]

_runner: GemmRunner | None = None


@dataclass(frozen=True)
class Availability:
    """Truthy when the kernels can run here; ``reason`` says why not otherwise."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _get_runner() -> GemmRunner:
    global _runner
    if _runner is None:
        _runner = GemmRunner()
    return _runner


def available() -> Availability:
    """Whether the built library, CuPy and an sm_90 GPU are all present."""
    try:
        _get_runner()
    except (FileNotFoundError, OSError, KeyError) as exc:
        return Availability(False, str(exc))
    try:
        import cupy

        cc = cupy.cuda.Device().compute_capability
    except Exception as exc:  # no CuPy, no driver or no device
        return Availability(False, f"no usable CUDA device: {exc}")
    if cc != "90":
        return Availability(False, f"kernels are built for sm_90a (Hopper); this device is sm_{cc}")
    return Availability(True)


def init() -> None:
    """Load every kernel onto every device; call before capturing CUDA graphs."""
    _get_runner().init()


def self_check(m: int = 3, n: int = 136, k: int = 264) -> None:
    """One small planned product, plain and with the residual added in place, against float32
    (``testing.gemm_check``); raises RuntimeError saying how it failed. For a user of the library
    to run once at start-up, after ``init`` and ``reserve_workspace``."""
    from .verification.checks import gemm_check

    for residual in ("", "inplace"):
        check = gemm_check(_get_runner(), None, m, n, k, residual)
        if not check.ok:
            raise RuntimeError(f"{m}x{n}x{k} product{' + R' if residual else ''}: relative error "
                               f"{check.err:.3g}, {check.unwritten} outputs unwritten {check.detail}".rstrip())


def reserve_workspace(max_m: int, shapes, buffer=None) -> None:
    """Pre-size the split-K workspace so GEMMs of at most ``max_m`` rows with these ``(N, K)``
    weights can be graph-captured; ``buffer``: use this device array (``split_workspace_bytes``)."""
    _get_runner().reserve_workspace(max_m, shapes, buffer)


def use_workspace(buffer) -> None:
    """Split-K products from here on write their partials into ``buffer`` (see ``reserve_workspace``)."""
    _get_runner().use_workspace(buffer)


def gemm(a, b, out, stream=None, residual=None, prefetch_weights: bool = False) -> None:
    """``out[M, N] = bf16(a[M, K] · b[N, K]ᵀ (+ residual[M, N]))``, fp32 accumulation, launched on
    ``stream`` as a programmatic dependent launch; the residual (which may be ``out`` itself) is added
    in the epilogue. ``prefetch_weights``: ``b`` is not written by the kernel just before, so its
    first k-tiles load while that kernel finishes. Where ``a`` is a view into a larger CuPy
    allocation (the engine's arena), its rows past M are read to whole tiles, which is faster than
    the TMA's zero fill; they affect no stored output."""
    _get_runner()(a, b, out, stream, residual=residual, prefetch_weights=prefetch_weights)


def gemm_partials(a, b, stream=None, residual: bool = False, prefetch_weights: bool = False) -> DeviceTensor | None:
    """Where the planned ``a · bᵀ`` splits in K (``residual``: the plan of ``out += a · bᵀ``), launch only
    its GEMM and return the float32 partial sums ``[S, M, N]`` for the caller's own reduction (valid
    until the next split product); None where it does not split (nothing launched)."""
    return _get_runner().partials(a, b, stream, residual=residual, prefetch_weights=prefetch_weights)


def gemm_swiglu(a, b, out, stream=None, prefetch_weights: bool = False) -> bool:
    """``out[M, N/2] = SiLU(gate)·up`` of ``a · bᵀ`` in one kernel, ``b``'s gate and up rows
    interleaved in blocks of 8; True where launched, False (nothing launched) where the planned
    tile has no SiLU·up twin."""
    return _get_runner().swiglu(a, b, out, stream, prefetch_weights=prefetch_weights)


def fp8_gemm(a, a_scales, b, b_scales, out, stream=None, prefetch_weights: bool = False) -> None:
    """The block-scaled W8A8 product (``gemm.fp8_gemm``): e4m3 activations ``a`` [M, K] with per-token 128-group
    scales [K/128, >= M], e4m3 weights ``b`` [N, K] with [ceil(N/128), K/128] block scales, bf16 ``out``."""
    _fp8_gemm(_get_runner(), a, a_scales, b, b_scales, out, stream, prefetch_weights=prefetch_weights)


def grouped_gemm(a, w, tile_expert, out, stream=None, prefetch_weights: bool = False) -> None:
    """MoE: ``out[r] = a[r] · w[tile_expert[r // tile_m]]ᵀ``; rows grouped by ``group_by_expert``."""
    _grouped_gemm(_get_runner(), a, w, tile_expert, out, stream, prefetch_weights)


def varlen_attention(q, k, v, o, cu_q, cu_k, work, stream=None, kernel=None) -> None:
    """Causal GQA prefill attention over packed sequences (head_dim 128 or 64); ``work`` from
    ``attention_work``; ``kernel`` names a variant (default: the verified one for the head dim)."""
    _varlen_attention(_get_runner(), q, k, v, o, cu_q, cu_k, work, stream, kernel)
