"""The mixture-of-experts op family on the GPU (ops.moe; models/ops.py MoEOps), a part GpuOps builds for a line
with routed experts, over the executor's GpuShared.

route: the router GEMM into float32 logits (cuBLAS), then moe_route.cu's softmax or sigmoid + top-k (greedy
or group-limited, with DeepSeek-V3's score correction bias where the line has one (held in bf16, as every
device weight), renormalized, scaled), one warp per token. experts: moe_align.cu groups the
(token, slot) assignments by expert on the device (each group padded to whole M-tiles), moe_permute.cu
gathers the activations into those rows, the grouped GEMM (openinfer_kernels.cute.grouped_gemm where the CuTe
library serves, else moe_grouped_gemm.cu) runs gate_up, silu_mul.cu the activation, the grouped GEMM
down, and moe_permute.cu's combine adds the routing-weighted rows to the residual stream. A decode step
of at most 4 tokens takes three launches instead: moe_route_gemv (the router product and the top-k in
one), moe_gemv_silu and moe_gemv_combine (each assignment reads its expert straight from the ids, the same
bits as the grouped path). Every launch has a grid fixed by the step's token count (the rows bound below),
nothing waits on the host: a decode step with experts is captured in its CUDA graph like a dense one.
DeepSeek-V4's sqrtsoftplus scores are moe_route.cu's third scoring; its limited SwiGLU (swiglu_limit) is
silu_mul.cu's silu_mul_limited (captured in that line's decode graphs too).
"""
from __future__ import annotations

import math

import numpy as np

from engine.models.ops import RouteSpec
from openinfer_kernels.raw_cuda import kernel
from memory.device_arena import Buffer, buffers_nbytes

MAX_ROUTED_EXPERTS = 512     # moe_route.cu MAX_E (moe_align.cu takes up to 1024)
MAX_TOP_K = 32
TILE_ROWS = (64, 128)        # the grouped GEMM's M-tiles
GEMV_MAX_TOKENS = 8          # steps of at most this many tokens run the experts on moe_gemv.cu (decode)
ROUTE_GEMV_TOKENS = 4        # the router in one launch (moe_route_gemv, at most its ROUTE_TOKENS = 8): at 8
                             # tokens cuBLAS + moe_topk was faster (H200, 2026-12-04: its last CTA routes serially)
FUSED_MAX_TOKENS = 4         # steps of at most this many tokens skip the grouping (moe_gemv_silu / _combine)
# moe_gemv.cu's compile variants (the same bits each), H200 in graphs (bench/moe_micro.py, 2026-12-04 19:45 UTC):
# COMBINE_COLS 4 against 8, µs a layer of moe_gemv_combine, DeepSeek-V2-Lite 1 / 4 tokens 13.6 -> 12.1 /
# 49.0 -> 41.5, Qwen3-30B-A3B 9.2 -> 8.7 / 30.3 -> 28.1; MOE_UNROLL 4 slowed moe_gemv_silu (16.5 -> 18.2).
MOE_UNROLL = 2               # moe_gemv.cu: 256-wide k steps whose weight loads a lane issues together
COMBINE_COLS = 4             # moe_gemv_combine's output columns per CTA
KERNEL_SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")    # RouteSpec.scoring moe_route.cu computes, its `scoring`


def expert_tile_m(tokens: int, top_k: int, experts: int) -> int:
    """M-tile of a step's grouped GEMMs: 128 rows once the experts average a full 128-row tile, else 64
    (decode: fewer padding rows). Not tuned."""
    return 128 if tokens * top_k >= 128 * experts else 64


def expert_tiles(tokens: int, top_k: int, experts: int, tile_m: int) -> int:
    """M-tiles that always hold the step's assignments: sum_e ceil(count_e / tile_m) is at most
    (tokens·top_k + nonempty experts·(tile_m - 1)) / tile_m."""
    n = tokens * top_k
    return -(-(n + min(experts, n) * (tile_m - 1)) // tile_m)


def expert_rows(tokens: int, top_k: int, experts: int) -> int:
    """Grouped rows of the largest step of `tokens` tokens, whichever tile it takes."""
    return max(expert_tiles(tokens, top_k, experts, m) * m for m in TILE_ROWS)


class GpuMoEOps:
    """ops.moe on the GPU: the router and the routed experts (its buffers carved from the arena at build)."""
    gemv_tokens = GEMV_MAX_TOKENS       # steps of at most this many tokens take moe_gemv.cu (0: never)
    fused_tokens = FUSED_MAX_TOKENS     # ... the ungrouped experts (0: never)
    route_gemv_tokens = ROUTE_GEMV_TOKENS  # ... the one-launch router (0: never)

    def __init__(self, plan, shared, arena):
        """Carve the plan's MoE buffers and load the kernels; the kernels' limits refused here."""
        import cupy

        s = plan.experts
        if s.num_experts > MAX_ROUTED_EXPERTS or s.top_k > MAX_TOP_K or s.hidden % 8 or s.inter % 8:
            raise ValueError(f"GPU MoE kernels need at most {MAX_ROUTED_EXPERTS} experts, top_k <= {MAX_TOP_K}, "
                             f"hidden and expert intermediate % 8 == 0; got {s}")
        self.shared, self.cp = shared, cupy
        self.buf = arena.take_all("moe", self.buffers(plan))
        shared.zero(self.buf["moe_counter"])      # moe_route_gemv's finishing count: zero between its launches
        max_e = self.route_max_e = 32 * -(-s.num_experts // 32)  # moe_route.cu's scores per lane: as the experts need
        self.k_topk = kernel("moe_route", "moe_topk", MAX_E=max_e)
        self.k_align = kernel("moe_align", "moe_align")
        self.k_gather = kernel("moe_permute", "moe_gather")
        self.k_combine = kernel("moe_permute", "moe_combine")
        self.k_grouped = kernel("moe_grouped_gemm", "moe_grouped_gemm")
        self.k_silu = kernel("silu_mul", "silu_mul")
        self.k_silu_limited = kernel("silu_mul", "silu_mul_limited")
        gemv = dict(MOE_UNROLL=MOE_UNROLL, COMBINE_COLS=COMBINE_COLS)     # bench/moe_micro.py's choice
        self.k_gemv = kernel("moe_gemv", "moe_gemv", **gemv)
        self.k_route_gemv = kernel("moe_route", "moe_route_gemv", MAX_E=max_e)
        self.k_gemv_silu = kernel("moe_gemv", "moe_gemv_silu", **gemv)
        self.k_gemv_combine = kernel("moe_gemv", "moe_gemv_combine", **gemv)

    @staticmethod
    def buffers(plan) -> list[Buffer]:
        """Router logits / weights / ids, the grouping's maps and two row buffers the grouped products
        alternate between (activations -> gate_up -> SiLU·up -> down)."""
        s = plan.experts
        if s is None:
            return []
        T, E, K, H, I = plan.max_tokens, s.num_experts, s.top_k, s.hidden, s.inter
        rows = expert_rows(T, K, E)
        return [Buffer("moe_logits", (T * E,), np.float32), Buffer("moe_weights", (T * K,), np.float32),
                Buffer("moe_ids", (T * K,), np.int32), Buffer("moe_row_of", (T * K,), np.int32),
                Buffer("moe_row_token", (rows,), np.int32), Buffer("moe_tile_expert", (rows // 64,), np.int32),
                Buffer("moe_a", (rows * max(H, I),), np.uint16), Buffer("moe_b", (rows * max(2 * I, H),), np.uint16),
                Buffer("moe_counter", (1,), np.int32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.buffers(plan))

    # ---- the router ------------------------------------------------------------------------------------
    def route(self, x, gate_weight, spec: RouteSpec, bias=None):
        """(weights, ids) views: moe_route.cu for softmax / sigmoid / sqrtsoftplus (DeepSeek-V4) scores (a decode
        step's product and top-k in one launch)."""
        if spec.scoring not in KERNEL_SCORINGS:
            raise ValueError(f"moe_route.cu has no {spec.scoring!r} scores")
        T, E = x.shape[0], spec.num_experts
        logits = self.buf["moe_logits"][:T * E].reshape(T, E)
        if T <= min(self.route_gemv_tokens, 8) and x.shape[1] % 8 == 0:     # 8: the kernel's ROUTE_TOKENS
            return self._route_gemv(x, gate_weight, logits, spec, bias)
        self.shared.gemm(x, gate_weight, logits)                    # fp32 output: cuBLAS
        return self.route_logits(logits, spec, bias)

    def router_logits(self, x, gate_weight):
        """float32 router logits [T, E] of x (cuBLAS) in the MoE logits buffer."""
        T, E = x.shape[0], gate_weight.shape[0]
        logits = self.buf["moe_logits"][:T * E].reshape(T, E)
        self.shared.gemm(x, gate_weight, logits)
        return logits

    def _check_experts(self, E: int) -> None:
        if E > self.route_max_e:
            raise ValueError(f"moe_route.cu was built for at most {self.route_max_e} experts, got {E}")

    def _route_out(self, T: int, K: int):
        """The routing's (weights [T, K] float32, ids [T, K] int32) views."""
        return self.buf["moe_weights"][:T * K].reshape(T, K), self.buf["moe_ids"][:T * K].reshape(T, K)

    @staticmethod
    def _route_args(spec: RouteSpec) -> tuple:
        """moe_route.cu's routing arguments after E: top_k .. sigmoid."""
        return (np.int32(spec.top_k), np.int32(spec.renormalize), np.float32(spec.scale), np.int32(spec.num_groups),
                np.int32(spec.topk_groups), np.int32(KERNEL_SCORINGS.index(spec.scoring)))

    def _route_gemv(self, x, gate_weight, logits, spec: RouteSpec, bias):
        """moe_route.cu moe_route_gemv: the router product and the top-k of a decode step in one launch."""
        T, H = x.shape
        E, K = spec.num_experts, spec.top_k
        self._check_experts(E)
        weights, ids = self._route_out(T, K)
        self.shared.launch(self.k_route_gemv, (-(-E // 4),), (128,),
                           (x, gate_weight, logits, self.buf["moe_counter"], bias if bias is not None else np.uint64(0),
                            weights, ids, np.int32(T), np.int32(E), np.int32(H), *self._route_args(spec)))
        return weights, ids

    def route_logits(self, logits, spec: RouteSpec, bias=None):
        """moe_route.cu over float32 router logits [T, E] (bias: bf16 [E] or None): (weights, ids) views."""
        T, E, K = logits.shape[0], spec.num_experts, spec.top_k
        self._check_experts(E)
        weights, ids = self._route_out(T, K)
        self.shared.launch(self.k_topk, (-(-T // 4),), (128,),
                           (logits, bias if bias is not None else np.uint64(0), weights, ids, np.int32(T), np.int32(E),
                            *self._route_args(spec)))
        return weights, ids

    # ---- the experts -----------------------------------------------------------------------------------
    def group_experts(self, ids, num_experts: int):
        """moe_align.cu over ids [T, top_k]: (tile_m, rows, row_of, row_token, tile_expert) device views."""
        T, K = ids.shape
        b = self.buf
        tile_m = expert_tile_m(T, K, num_experts)
        tiles = expert_tiles(T, K, num_experts, tile_m)
        rows = tiles * tile_m
        row_of, row_token = b["moe_row_of"][:T * K], b["moe_row_token"][:rows]
        tile_expert = b["moe_tile_expert"][:tiles]
        self.shared.launch(self.k_align, (1,), (1024,),
                           (ids, np.int32(T), np.int32(K), np.int32(num_experts), np.int32(tile_m), np.int32(tiles),
                            row_of, row_token, tile_expert))
        return tile_m, rows, row_of, row_token, tile_expert

    def grouped_linear(self, a, w, tile_expert, row_token, out, tile_m: int, tokens: int) -> None:
        """out[r] = a[r] · w[tile_expert[r // tile_m]]ᵀ: moe_gemv.cu for a step of at most gemv_tokens
        tokens (a few real rows per tile: the experts' weights read once, no padded rows computed), else the
        CuTe grouped GEMM where it serves, else moe_grouped_gemm.cu (tensor-core mma, graph-capturable too)."""
        sh = self.shared
        if tokens <= self.gemv_tokens:
            N, K = w.shape[1], w.shape[2]
            sh.launch(self.k_gemv, (-(-N // 32), a.shape[0] // tile_m), (128,),
                      (a, w, tile_expert, row_token, out, np.int32(N), np.int32(K), np.int32(tile_m)))
            return
        if sh.gemm.cute is not None:
            sh.gemm.cute.grouped_gemm(a, w, tile_expert, out, stream=sh.stream, prefetch_weights=True)
            return
        M, K = a.shape
        N = w.shape[1]
        sh.launch(self.k_grouped, (-(-N // 64), M // 64), (128,),
                  (a, w, tile_expert, row_token, out, np.int32(M), np.int32(N), np.int32(K), np.int32(tile_m)))

    def expert_activation(self, gate_up, out, limit) -> None:
        """silu_mul.cu over the gate_up rows into out (bf16 [rows, inter], inter % 8 == 0: checked at start); with a
        finite limit (DeepSeek-V4's swiglu_limit) its limited form, silu_mul_limited."""
        sh = self.shared
        rows, inter = out.shape
        limited = limit is not None and not math.isinf(limit)
        total = rows * inter // 8
        if not total:
            return
        args = (gate_up, out, np.int32(inter), np.int64(total), np.int32(sh.gate_up_interleaved))
        sh.launch(self.k_silu_limited if limited else self.k_silu, (max(1, min(4096, -(-total // 256))),), (256,),
                  args + ((np.float32(limit),) if limited else ()))

    @staticmethod
    def expert_dims(w) -> tuple[int, int, int]:
        """(experts, N, K) of a stacked expert weight."""
        return tuple(w.shape)

    @staticmethod
    def fusable(w) -> bool:
        """The ungrouped decode kernels (moe_gemv.cu) read this expert weight (bf16 [E, N, K])."""
        return True

    def experts(self, x, gate_up, down, weights, ids, residual, limit=None):
        T, H = x.shape
        E, two_i, _ = self.expert_dims(gate_up)
        inter = two_i // 2
        if T <= self.fused_tokens and self.fusable(gate_up) and (limit is None or limit == float("inf")):
            return self._experts_ungrouped(x, gate_up, down, weights, ids, residual)
        tile_m, rows, row_of, row_token, tile_expert = self.group_experts(ids, E)
        b, sh = self.buf, self.shared
        a = b["moe_a"][:rows * H].reshape(rows, H)
        sh.launch(self.k_gather, (rows,), (128,), (x, row_token, a, np.int32(H)))
        gu = b["moe_b"][:rows * two_i].reshape(rows, two_i)
        self.grouped_linear(a, gate_up, tile_expert, row_token, gu, tile_m, T)
        act = b["moe_a"][:rows * inter].reshape(rows, inter)
        self.expert_activation(gu, act, limit)
        y = b["moe_b"][:rows * H].reshape(rows, H)
        self.grouped_linear(act, down, tile_expert, row_token, y, tile_m, T)
        out = sh.residual_out(T, H)
        sh.launch(self.k_combine, (T,), (128,),
                  (y, row_of, weights, residual, out, np.int32(H), np.int32(ids.shape[1])))
        return out

    def _experts_ungrouped(self, x, gate_up, down, weights, ids, residual):
        """A step of a few tokens: moe_gemv_silu then moe_gemv_combine over the (token, slot) assignments
        as routed, no grouping by expert (moe_gemv.cu)."""
        T, H = x.shape
        inter = gate_up.shape[1] // 2
        K, sh = ids.shape[1], self.shared
        act = self.buf["moe_a"][:T * K * inter].reshape(T * K, inter)
        sh.launch(self.k_gemv_silu, (-(-inter // 16), T * K), (128,),
                  (x, gate_up, ids, act, np.int32(inter), np.int32(H), np.int32(K),
                   np.int32(sh.gate_up_interleaved)))
        out = sh.residual_out(T, H)
        sh.launch(self.k_gemv_combine, (-(-H // COMBINE_COLS), T), (32 * min(K, 8),),
                  (act, down, ids, weights, residual, out, np.int32(H), np.int32(inter), np.int32(K)))
        return out
