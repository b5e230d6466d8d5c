"""Prefill attention on tensor cores: the CuTe DSL varlen FlashAttention kernel (openinfer_kernels/cute
`varlen_attention`) for the sequences of an eager step that feed many tokens.

paged_decode.cu walks each query token's whole prefix on CUDA cores, O(T²) key reads for a T-token
prompt. Here a sequence feeding at least `min_query` tokens is served by the CuTe kernel instead:
per layer, after qkv_rope_cache has written the step's keys into the paged cache, kv_gather.cu copies
each such sequence's K/V (cached prefix + new tokens) into contiguous scratch rows, and one
varlen_attention launch runs over the packed sequences (query rows aligned to the end of each
sequence's keys, so a cached prefix works). The other sequences of the step (decodes, short chunks)
stay on the paged kernel, which runs first with their positions only (-1 elsewhere: zero rows the
CuTe launch then overwrites), except short runs of 2 or more new tokens, which paged_chunk.cu serves
(gpu_chunk.py: tensor cores straight from the paged cache, after the paged kernel). Consecutive served sequences share one launch while their contexts fit
the scratch; a sequence between them that is not served splits the launches.

Switch: GpuTuning.prefill_attention ($OPENINFER_PREFILL_ATTENTION): "cute" (default; when the
CuTe library is built and available, head_dim is 64 or 128 and the scale is 1/sqrt(head_dim)),
"cute:N" (serve sequences of at least N new tokens), "paged" (never).

Memory (arena, taken once): K and V scratch of `key_rows` = max_model_len + max_num_batched_tokens rows
of Hkv·D bf16 each (any one sequence fits; Qwen3-4B at 40960 + 2048: 176 MB), plus a small int32
upload buffer (cu_q, cu_k, tile list, paged positions) and its pinned host twin. Eager steps only:
decode graphs never see it.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from engine.batch import ModelBatch
from engine.executor.gpu_chunk import MIN_CHUNK_TOKENS, ChunkKernel, chunk_fits, chunk_tiles
from memory.device_arena import Buffer, buffers_nbytes
from memory.kv_format import KVFormat
from memory.kv_pool import BLOCK_SIZE
from memory.streams import PinnedTwins
from openinfer_kernels.raw_cuda import kernel
from openinfer_kernels.raw_cuda.launch import launch

log = logging.getLogger(__name__)
DEFAULT_MIN_QUERY = 64          # new tokens of a sequence from which the CuTe kernel serves it
CUTE_HEAD_DIMS = (64, 128)
ALIGN = 4                       # int32 entries: each uploaded array starts 16-byte aligned
GATHER_THREADS = 256


def parse_prefill_attention(spec: str) -> int | None:
    """"cute" -> DEFAULT_MIN_QUERY, "cute:N" -> N, "paged" -> None."""
    item = spec.strip().lower()
    if item in ("paged", "none", "off", "0"):
        return None
    if item == "cute":
        return DEFAULT_MIN_QUERY
    if item.startswith("cute:"):
        try:
            n = int(item[5:])
        except ValueError:
            n = 0
        if n >= 1:
            return n
    raise ValueError(f"prefill attention: {spec!r} is not one of cute, cute:N (N >= 1), paged")


def prefill_min_query(spec: str, head_dim: int) -> int | None:
    """The executor's setting (GpuTuning.prefill_attention): the min query length the CuTe kernel
    serves, or None when the paged kernel serves every step (asked, or CuTe can't)."""
    min_query = parse_prefill_attention(spec)
    if min_query is None:
        return None
    if head_dim not in CUTE_HEAD_DIMS:
        log.info("prefill attention: paged (the CuTe kernel takes head_dim %s, not %d)", CUTE_HEAD_DIMS, head_dim)
        return None
    import openinfer_kernels.cute as cute

    ok = cute.available()
    if not ok:
        log.info("prefill attention: paged (CuTe library unavailable: %s)", ok.reason)
        return None
    return min_query


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def upload_entries(max_tokens: int, max_seqs: int) -> int:
    """int32 entries of the largest plan (at most one launch per sequence): cu_q and cu_k (n + 1 each)
    and the [tiles, 2] work list (tiles <= T/128 + B) per launch, each padded to ALIGN, then T paged
    positions: <= 15·B + T + T/64 + ALIGN; the chunk kernel's [tiles, 2] (tiles <= T + B at one token
    a tile): 2·(T + B) + ALIGN more; rounded up."""
    return 4 * max_tokens + 18 * max_seqs + 3 * ALIGN


@dataclass(frozen=True)
class AttentionLaunch:
    """One kv_gather + varlen_attention launch over sequences [first_seq, first_seq + num_seqs) of the step."""
    first_seq: int
    num_seqs: int
    q_rows: tuple[int, int]     # their query rows [start, end) in the step's flattened tokens
    key_rows: int               # gathered K/V rows: the sum of their context lengths
    key_blocks: int             # 16-token blocks of the longest context (the gather grid's x)
    cu_q: int                   # offsets of cu_q, cu_k and the work list in the plan's data
    cu_k: int
    work: int
    tiles: int


@dataclass
class PrefillPlan:
    """Host side of one step: the launches and the int32 data they read (uploaded as one copy)."""
    launches: list[AttentionLaunch]
    data: np.ndarray                    # int32: each launch's cu_q, cu_k, work; then the paged positions
    paged_positions: int | None         # offset of the paged kernel's positions, None: no row left to it
    paged_rows: tuple[int, int] = (0, 0)    # [first, end) rows the paged kernel launches over (all it serves)
    paged_context: int = 0              # the longest context among them (the paged launch's split count)
    chunk_tiles: int = 0                # paged_chunk.cu's tiles ([n, 2] at chunk_work in data)
    chunk_work: int = 0
    chunk_context: int = 0              # the longest context among its sequences (its split count)


def plan_prefill(cu_seqlens: np.ndarray, context_lens: np.ndarray, positions: np.ndarray,
                 min_query: int, max_key_rows: int, chunk_tokens: int = 0) -> PrefillPlan | None:
    """Group the sequences with at least min_query new tokens (and a context that fits the scratch)
    into launches of consecutive sequences whose contexts together fit max_key_rows; with chunk_tokens
    (paged_chunk.cu's tokens per tile), the others of 2 or more new tokens into its tiles. None if
    neither serves a sequence."""
    from openinfer_kernels.cute.attention import attention_work

    lens = np.diff(cu_seqlens)
    served = (lens >= min_query) & (context_lens <= max_key_rows)
    chunked = ~served & (lens >= MIN_CHUNK_TOKENS) if chunk_tokens else np.zeros_like(served)
    if not served.any() and not chunked.any():
        return None
    groups: list[list[int]] = []
    rows = 0
    for b in np.flatnonzero(served).tolist():
        ctx = int(context_lens[b])
        if groups and groups[-1][-1] == b - 1 and rows + ctx <= max_key_rows:
            groups[-1].append(b)
            rows += ctx
        else:
            groups.append([b])
            rows = ctx
    chunks, launches, at = [], [], 0

    def put(a: np.ndarray) -> int:
        nonlocal at
        start, n = at, _aligned(a.size)
        chunks.append(np.pad(a.astype(np.int32).ravel(), (0, n - a.size)))
        at += n
        return start

    for g in groups:
        first, last = g[0], g[-1]
        cu_q = (cu_seqlens[first:last + 2] - cu_seqlens[first]).astype(np.int32)
        ctx = context_lens[first:last + 1]
        cu_k = np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32)
        work = attention_work(cu_q)
        launches.append(AttentionLaunch(
            first_seq=first, num_seqs=len(g), q_rows=(int(cu_seqlens[first]), int(cu_seqlens[last + 1])),
            key_rows=int(cu_k[-1]), key_blocks=int(-(-ctx.max() // BLOCK_SIZE)),
            cu_q=put(cu_q), cu_k=put(cu_k), work=put(work), tiles=int(work.shape[0])))
    tiles, work, chunk_context = 0, 0, 0
    if chunked.any():
        tile_list = chunk_tiles(cu_seqlens, chunked, chunk_tokens)
        tiles, work, chunk_context = tile_list.shape[0], put(tile_list), int(context_lens[chunked].max())
    paged, rows, longest = None, (0, 0), 0
    left_seqs = ~served & ~chunked
    if left_seqs.any():
        mine = np.repeat(~left_seqs, lens)
        paged = put(np.where(mine, -1, positions))
        left = np.flatnonzero(~mine)
        rows = (int(left[0]), int(left[-1]) + 1)
        longest = int(context_lens[left_seqs].max())
    return PrefillPlan(launches=launches, data=np.concatenate(chunks), paged_positions=paged, paged_rows=rows,
                       paged_context=longest, chunk_tiles=tiles, chunk_work=work, chunk_context=chunk_context)


class PrefillAttention:
    """The executor's CuTe prefill path: scratch, upload buffers, the gather kernel; `step(batch)` plans
    and uploads one eager step (None when no sequence of it is served)."""

    def __init__(self, arena, stream, max_tokens: int, max_seqs: int, key_rows: int, num_kv_heads: int,
                 head_dim: int, min_query: int, group: int = 0, kv_format: KVFormat = KVFormat()):
        self.stream, self.min_query, self.key_rows = stream, min_query, key_rows
        b = arena.take_all("prefill", self.buffers(key_rows, num_kv_heads, head_dim, max_tokens, max_seqs))
        self.k, self.v, self.data = b["k"], b["v"], b["plan"]
        # the plan's staging (as StepInputs'): async scheduling plans and uploads the next eager steps while
        # this one's copy may still wait in the stream behind earlier work
        self.data_hosts = PinnedTwins(self.data.shape, np.int32)
        self.mapped = None          # a MappedCopy: the plan uploaded by a kernel while set (as StepInputs.mapped)
        # the cache's K/V to the bf16 staging (an e4m3 cache widened on the way: kv_gather_fp8)
        self.gather = kernel("kv_gather", "kv_gather_fp8" if kv_format.fp8 else "kv_gather")
        self.launches = 0           # varlen_attention launches so far (tests check the path ran)
        # paged_chunk.cu for short runs (group: query heads per KV head; 0 = off)
        self.chunk = ChunkKernel(group, head_dim, stream) if group and chunk_fits(group, head_dim) else None

    @staticmethod
    def buffers(key_rows: int, num_kv_heads: int, head_dim: int, max_tokens: int, max_seqs: int) -> list[Buffer]:
        kv = (key_rows, num_kv_heads, head_dim)
        return [Buffer("k", kv, np.uint16), Buffer("v", kv, np.uint16),
                Buffer("plan", (upload_entries(max_tokens, max_seqs),), np.int32)]

    @staticmethod
    def plan_key_rows(plan) -> int:
        """Gathered K/V rows: any one sequence's context (max_model_len) plus a step's tokens."""
        return plan.max_model_len + plan.max_tokens

    @classmethod
    def nbytes(cls, plan) -> int:
        kv = plan.kv
        return buffers_nbytes(cls.buffers(cls.plan_key_rows(plan), kv.heads, kv.dim, plan.max_tokens, plan.max_seqs))

    def step(self, batch: ModelBatch) -> "PrefillStep | None":
        if self.min_query is None or batch.is_decode_only:
            return None
        plan = plan_prefill(batch.cu_seqlens, batch.context_lens, batch.positions, self.min_query, self.key_rows,
                            self.chunk.tokens if self.chunk is not None else 0)
        if plan is None:
            return None
        n = plan.data.size
        if n > self.data.size:
            raise ValueError(f"prefill plan of {n} entries exceeds its {self.data.size}-entry buffer")
        import cupy

        host = self.data_hosts.take()
        host[:n] = plan.data
        if self.mapped is not None:
            self.mapped([(host, self.data, n)], to_host=False)
        else:
            cupy.cuda.runtime.memcpyAsync(self.data.data.ptr, host.ctypes.data, n * 4,
                                          cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        self.data_hosts.sent(self.stream)
        return PrefillStep(self, plan)


@dataclass
class PrefillStep:
    """One step's served sequences (GpuStepContext.prefill); GpuOps.attention hands them to `attention`."""
    owner: PrefillAttention
    plan: PrefillPlan

    @staticmethod
    def cute_serves(spec) -> bool:
        return spec.head_dim in CUTE_HEAD_DIMS and abs(spec.scale * spec.head_dim ** 0.5 - 1) < 1e-6

    def serves(self, spec) -> bool:
        """This layer goes through the plan: CuTe takes its shape, and so does the chunk kernel where
        the plan has tiles for it (else the paged kernel serves the whole layer)."""
        chunk = self.owner.chunk
        return self.cute_serves(spec) and (not self.plan.chunk_tiles or (
            spec.head_dim == chunk.head_dim and spec.num_heads == chunk.group * spec.num_kv_heads))

    def attention(self, ops, q, spec, ctx, out=None):
        """o[T, Hq·D]: the paged kernel for the rows no launch serves (launched over their span only, its
        split count theirs: decode rows before 8k prompt tokens do not pay for 8k empty query CTAs), then
        the short runs' paged_chunk.cu tiles and gather + CuTe per launch (overwriting the span's served
        rows, which the paged kernel zeroed)."""
        import openinfer_kernels.cute as cute

        own, plan, d = self.owner, self.plan, self.owner.data
        T, Hq, Hkv, D = ctx.num_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim
        if out is None:
            out = ops.activation(T, Hq * D)
        if plan.paged_positions is not None:
            (r0, r1), at = plan.paged_rows, plan.paged_positions
            span = dataclasses.replace(ctx, num_tokens=r1 - r0, positions=d[at + r0:at + r1],
                                       token_seq=ctx.token_seq[r0:r1], slot_mapping=ctx.slot_mapping[r0:r1],
                                       input_ids=ctx.input_ids[r0:r1], prefill=None,
                                       num_splits=ops.splits(r1 - r0, Hkv, plan.paged_context))
            ops.paged_attention(q[r0:r1], spec, span, out[r0:r1])
        if plan.chunk_tiles:
            own.chunk.launch(ops, q, spec, ctx, out, d[plan.chunk_work:plan.chunk_work + 2 * plan.chunk_tiles],
                             plan.chunk_tiles, plan.chunk_context)
        o = out.reshape(T, Hq, D)
        kc, vc = ops.shared.kv_cache[spec.layer, 0], ops.shared.kv_cache[spec.layer, 1]
        width = ctx.block_tables.shape[1]
        for a in plan.launches:
            cu_k = d[a.cu_k:a.cu_k + a.num_seqs + 1]
            k, v = own.k[:a.key_rows], own.v[:a.key_rows]
            launch(own.gather, (a.key_blocks, a.num_seqs), (GATHER_THREADS,),
                   (kc, vc, ctx.block_tables[a.first_seq:], np.int32(width), cu_k, k, v, np.int32(Hkv * D // 8))
                   + ops.shared.kv_scales(spec.layer), own.stream)
            r0, r1 = a.q_rows
            cute.varlen_attention(q[r0:r1], k, v, o[r0:r1], d[a.cu_q:a.cu_q + a.num_seqs + 1], cu_k,
                                  d[a.work:a.work + 2 * a.tiles].reshape(a.tiles, 2), stream=own.stream)
            own.launches += 1
        return out
