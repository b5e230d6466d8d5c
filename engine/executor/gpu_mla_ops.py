"""The multi-head latent attention op family on the GPU (ops.mla; models/ops.py MLAOps), a part GpuOps builds for
an MLA line over the executor's GpuShared and the dense ops' split attention kernels (GpuOps.split_attention).

latent_cache: mla_latent_cache.cu (latent RMSNorm + interleaved rope + the one-plane cache write,
and the query columns, RMSNorm'd when q_lora_rank is set). With --kv-cache-dtype fp8 the cache rows are e4m3
(the layer's k_scale; gpu_kv_format.py) and every kernel that touches them takes its FP8 form: the _fp8 entries
of mla_latent_cache.cu, mla_absorb.cu and mla_prefill.cu, mla_decode.cu built with KV_FP8=1. attention picks
the form per step:
  * absorbed (decode, and any step whose contexts do not fit the expansion rows): q_lat = W_UKᵀ·q_nope
    per head (one cuBLAS strided-batched GEMM reading kv_b_proj in place, float32 out: Gemm.strided_batched), mla_decode.cu
    over the latent cache (one launch: its last split per head group merges the splits), o = W_UV·o_lat
    per head (a second strided-batched GEMM); steps of at most mla_absorb_tokens tokens can take
    mla_absorb.cu's two kernels for the projections instead (their weights read before the
    programmatic-launch wait). Graph-capturable: every grid depends on the token count alone.
  * expanded (eager steps with a prefill, contexts that fit): the context's latents gathered
    (mla_prefill.cu), one GEMM by kv_b_proj, K and V (V zero-padded to the key width) laid out in whole
    16-token blocks per sequence, and paged_attention.cu's kernels as plain multi-head attention.
"""
from __future__ import annotations

import numpy as np

from engine.executor.gpu_gemm import CUBLAS_OP_N, CUBLAS_OP_T
from engine.models.ops import MLASpec
from openinfer_kernels.raw_cuda import kernel
from memory.device_arena import Buffer, buffers_nbytes
from memory.kv_pool import BLOCK_SIZE, blocks_for

MLA_MAX_GROUP = 16                # mla_decode.cu MAX_G: heads per CTA at most
MLA_MAX_SPLITS = 32               # mla_decode.cu MAX_SPLITS
MLA_CHUNK = 32                    # mla_decode.cu CHUNK: latent rows staged in shared memory
MLA_MAX_EXPAND_ROWS = 1 << 15     # cap of the expansion rows (their K and V: 2·rows·heads·(nope + rope)·2 bytes)
MLA_ABSORB_MAX_TOKENS = 8         # mla_absorb.cu MAX_T


def mla_decode_shape(num_tokens: int, num_splits: int, num_heads: int, num_sms: int) -> tuple[int, int]:
    """(splits, heads per CTA) of mla_decode.cu: the step's splits, and the largest head group (<= 16,
    halved from there) whose grid tokens x splits x groups still fills the SMs once (batch 1, 16 splits,
    16 heads: 1 head per CTA, 256 CTAs; batch 32+: 16). Fewer heads per CTA read the latent more times
    (from L2) but wait on fewer serial round trips."""
    S, G = max(1, min(num_splits, MLA_MAX_SPLITS)), min(MLA_MAX_GROUP, num_heads)
    while G > 1 and num_tokens * S * -(-num_heads // G) < num_sms:
        G = -(-G // 2)
    return S, G


def mla_decode_smem(rope_dim: int, kv_rank: int, group: int, kv_itemsize: int = 2) -> int:
    """mla_decode.cu's dynamic shared memory: CHUNK latent rows (bf16, or e4m3: kv_itemsize 1) and `group`
    float32 query rows."""
    row = kv_rank + rope_dim
    return MLA_CHUNK * row * kv_itemsize + group * row * 4


def expand_rows(plan) -> int:
    """Rows of the expanded form's K and V: a full step of fresh prompts and one max_model_len context,
    in whole blocks per sequence, at most MLA_MAX_EXPAND_ROWS."""
    blocks = blocks_for(plan.max_tokens + plan.max_model_len) + plan.max_seqs
    return BLOCK_SIZE * min(blocks, blocks_for(MLA_MAX_EXPAND_ROWS))


def expansion(batch, max_blocks: int, rows_cap: int):
    """Host plan of the expanded form for a step (None where its contexts need more than rows_cap rows):
    (rows, src_slots int32 [rows], tables int32 [B, max_blocks]); sequence b's position p is expansion
    row tables[b, p // 16] · 16 + p % 16, which holds the cache slot src_slots[row] (-1: padding)."""
    lens = [int(n) for n in batch.context_lens]
    blocks = [blocks_for(n) for n in lens]
    rows = BLOCK_SIZE * sum(blocks)
    if rows > rows_cap:
        return None
    src = np.full(rows, -1, np.int32)
    tables = np.zeros((len(lens), max_blocks), np.int32)
    first = 0
    for b, (n, nb) in enumerate(zip(lens, blocks)):
        tables[b, :nb] = np.arange(first, first + nb)
        p = np.arange(n)
        src[first * BLOCK_SIZE + p] = batch.block_tables[b, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        first += nb
    return rows, src, tables


class GpuMLAOps:
    """ops.mla on the GPU; attention: the dense ops (their split attention kernels and partials)."""
    # steps of at most this many tokens take mla_absorb.cu's projections instead of cuBLAS (0: never; up to
    # MLA_ABSORB_MAX_TOKENS): DeepSeek-V2-Lite's batch-1 graph step 1.250 -> 1.111 ms (moe.md, 2026-12-04 19:28).
    absorb_tokens = 8

    def __init__(self, plan, shared, arena, attention):
        """Carve the plan's MLA buffers and load the kernels; the kernels' limits refused here."""
        s = plan.mla
        if s.kv_lora_rank % 8 or s.rope_dim % 8 or s.qk_dim > 256 or s.qk_dim % 2:
            raise ValueError(f"GPU MLA kernels need kv_lora_rank and qk_rope_head_dim % 8 == 0 and an even "
                             f"nope + rope <= 256; got {s}")
        self.shared, self.dense = shared, attention
        self.fp8, self.kv_itemsize = shared.kv_format.fp8, shared.kv_format.itemsize(2)
        self.buf = arena.take_all("mla", self.buffers(plan))
        shared.zero(self.buf["mla_counters"])       # zero between launches (the last split resets its own)
        self.expand_cap = expand_rows(plan)
        self.max_blocks = plan.max_blocks
        entry = shared.kv_entry                     # "_fp8" for the e4m3 cache
        self.k_cache = kernel("mla_latent_cache", "mla_latent_cache" + entry)

        def decode_kernel(early: int):
            k = kernel("mla_decode", "mla_decode_split", KV_RANK=s.kv_lora_rank, ROPE_DIM=s.rope_dim, EARLY_CHUNK=early,
                       KV_FP8=int(self.fp8))
            k.max_dynamic_shared_size_bytes = mla_decode_smem(s.rope_dim, s.kv_lora_rank, MLA_MAX_GROUP,
                                                              self.kv_itemsize)
            return k
        self.k_decode = decode_kernel(1)
        # Where q_lora_rank is unset, mla_absorb_q_cache writes the step's latent rows in the launch right
        # before the attention: that one reads its first rows after the programmatic-launch wait.
        self.k_decode_late = decode_kernel(0) if s.q_cols == s.num_heads * s.qk_dim else None
        self.absorb_fits = s.nope_dim <= 256 and s.kv_lora_rank <= 1024      # mla_absorb.cu MAX_ROWS, MAX_PIECES
        self.k_absorb_q = kernel("mla_absorb", "mla_absorb_q")
        self.k_absorb_o = kernel("mla_absorb", "mla_absorb_o")
        self.k_absorb_q_cache = kernel("mla_absorb", "mla_absorb_q_cache" + entry)
        self.k_gather = kernel("mla_prefill", "mla_gather_latent" + entry)
        self.k_expand = kernel("mla_prefill", "mla_expand_kv" + entry)
        self.k_q_rope = kernel("mla_prefill", "mla_q_rope")
        self.k_compact = kernel("mla_prefill", "mla_compact_o")

    @staticmethod
    def buffers(plan) -> list[Buffer]:
        """q_lat (float32) and o_lat per token and head, the absorbed kernel's split partials (splits only
        run while tokens x splits < 4 x SMs) and split tickets (one per token and head group), and the
        expanded form's rows."""
        s = plan.mla
        if s is None:
            return []
        T, H, R, N, V = plan.max_tokens, s.num_heads, s.kv_lora_rank, s.nope_dim, s.v_dim
        parts, xr = 4 * plan.device.num_sms * H, expand_rows(plan)
        return [Buffer("mla_q_lat", (T * H * R,), np.float32), Buffer("mla_o_lat", (T * H * R,), np.uint16),
                Buffer("mla_part_out", (parts * R,), np.float32), Buffer("mla_part_max", (parts,), np.float32),
                Buffer("mla_part_sum", (parts,), np.float32), Buffer("mla_counters", (T * H,), np.int32),
                Buffer("mla_x_slots", (xr,), np.int32),
                Buffer("mla_x_tables", (plan.max_seqs * plan.max_blocks,), np.int32),
                Buffer("mla_x_latent", (xr * R,), np.uint16), Buffer("mla_x_kv", (xr * H * (N + V),), np.uint16),
                Buffer("mla_x_k", (xr * H * s.qk_dim,), np.uint16), Buffer("mla_x_v", (xr * H * s.qk_dim,), np.uint16)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.buffers(plan))

    # ---- MLAOps ----------------------------------------------------------------------------------
    def latent_cache(self, y, spec: MLASpec, ctx, kv_norm, q_norm=None):
        T, sh = ctx.num_tokens, self.shared
        q = sh.out(T, spec.q_cols)
        sh.launch(self.k_cache, (T,), (128,),
                  (y, np.int32(spec.q_cols), np.int32(spec.kv_lora_rank), np.int32(spec.rope_dim), kv_norm,
                   np.uint64(0) if q_norm is None else q_norm, np.float32(spec.rms_eps), sh.inv_freq,
                   np.float32(sh.attention_factor), ctx.positions, ctx.slot_mapping,
                   sh.kv_cache[spec.layer, 0], q) + self._scale(spec.layer))
        return q

    def _kv_scale(self, layer: int) -> np.float32:
        """The latent plane's k_scale of a layer (1 for the bf16 cache)."""
        return np.float32(self.shared.kv_format.scales[layer, 0] if self.fp8 else 1)

    def _scale(self, layer: int) -> tuple:
        """The FP8 entries' trailing k_scale argument of a layer; () for bf16."""
        return (self._kv_scale(layer),) if self.fp8 else ()

    def attention(self, q, kv_b, spec: MLASpec, ctx):
        plan = self._expansion(spec, ctx)
        if plan is None:
            return self._absorbed(q, kv_b, spec, ctx)
        return self._expanded(q, kv_b, spec, ctx, plan)

    def latent_attention(self, y, kv_b, spec: MLASpec, ctx, kv_norm):
        """q_lora_rank unset, a step of mla_absorb.cu's size in the absorbed form: mla_absorb_q_cache does the
        cache write and W_UK's absorption of q in one launch (then mla_decode.cu and W_UV as attention);
        else the composition."""
        T, H, R, sh = ctx.num_tokens, spec.num_heads, spec.kv_lora_rank, self.shared
        if not self._raw(T) or spec.q_cols != H * spec.qk_dim or self._expansion(spec, ctx) is not None:
            return self.attention(self.latent_cache(y, spec, ctx, kv_norm), kv_b, spec, ctx)
        q, q_lat = sh.out(T, spec.q_cols), self.buf["mla_q_lat"][:T * H * R]
        sh.launch(self.k_absorb_q_cache, (-(-R // 64) + 1, H), (256,),
                  (y, kv_b, q_lat, np.int32(T), np.int32(H), np.int32(spec.nope_dim), np.int32(spec.v_dim), np.int32(R),
                   np.int32(spec.qk_dim), np.int32(spec.rope_dim), kv_norm, np.float32(spec.rms_eps), sh.inv_freq,
                   np.float32(sh.attention_factor), ctx.positions, ctx.slot_mapping, sh.kv_cache[spec.layer, 0], q)
                  + self._scale(spec.layer))
        return self._absorbed(q, kv_b, spec, ctx, q_absorbed=True)

    def _raw(self, tokens: int) -> bool:
        """Whether a step of `tokens` query rows takes mla_absorb.cu's projections."""
        return tokens <= min(self.absorb_tokens, MLA_ABSORB_MAX_TOKENS) and self.absorb_fits

    # ---- absorbed form ---------------------------------------------------------------------------
    def _decode_shape(self, tokens: int, splits: int, heads: int) -> tuple[int, int]:
        """(splits, heads per CTA) of mla_decode.cu for a step: mla_decode_shape, one split where its partials
        would not fit."""
        S, G = mla_decode_shape(tokens, splits, heads, self.shared.num_sms)
        if tokens * S * heads > self.buf["mla_part_max"].shape[0]:
            S, G = 1, min(MLA_MAX_GROUP, heads)
        return S, G

    def _absorbed(self, q, kv_b, spec: MLASpec, ctx, q_absorbed: bool = False):
        """q_absorbed: q_lat already holds W_UKᵀ·q_nope (mla_absorb_q_cache)."""
        T, H, R, N, V = ctx.num_tokens, spec.num_heads, spec.kv_lora_rank, spec.nope_dim, spec.v_dim
        b, sh, head = self.buf, self.shared, (N + V) * R      # kv_b's stride between heads, in values
        q_lat, o_lat = b["mla_q_lat"][:T * H * R], b["mla_o_lat"][:T * H * R]
        raw = self._raw(T)
        # q_lat[t, h] = W_UK_hᵀ q_nope[t, h]: column-major q_latᵀ [R, T] = W_UK_hᵀ [R, N] · q_nopeᵀ [N, T]
        if raw and not q_absorbed:
            sh.launch(self.k_absorb_q, (-(-R // 64), H), (256,),
                      (q, kv_b, q_lat, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R),
                       np.int32(spec.qk_dim)))
        elif not q_absorbed:
            sh.gemm.strided_batched(CUBLAS_OP_N, R, T, N, kv_b, 0, R, head, q, 0, H * spec.qk_dim, spec.qk_dim,
                                    q_lat, H * R, R, H)
        S, G = self._decode_shape(T, ctx.num_splits, H)
        bt = ctx.block_tables
        sh.launch(self.k_decode_late if q_absorbed else self.k_decode, (-(-H // G), S, T), (256,),
                  (q_lat, q, np.int32(spec.qk_dim), np.int32(N), sh.inv_freq, np.float32(sh.attention_factor),
                   sh.kv_cache[spec.layer, 0], bt, np.int32(bt.shape[1]), ctx.token_seq, ctx.positions,
                   b["mla_part_out"], b["mla_part_max"], b["mla_part_sum"], o_lat, b["mla_counters"], np.int32(H),
                   np.int32(G), np.float32(spec.scale), self._kv_scale(spec.layer)),
                  shared_mem=mla_decode_smem(spec.rope_dim, R, G, self.kv_itemsize))
        # o[t, h] = W_UV_h o_lat[t, h]: column-major oᵀ [V, T] = (W_UV_h as [R, V])ᵀ · o_latᵀ [R, T]
        o = sh.out(T, H * V)
        if raw:
            sh.launch(self.k_absorb_o, (-(-V // 8), H), (256,),
                      (o_lat, kv_b, o, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R)))
        else:
            sh.gemm.strided_batched(CUBLAS_OP_T, V, T, R, kv_b, N * R, R, head, o_lat, 0, H * R, R, o, H * V, V, H)
        return o

    # ---- expanded form ---------------------------------------------------------------------------
    def _expansion(self, spec: MLASpec, ctx):
        """(rows, src_slots, tables) device views of an eager prefill step whose contexts fit the
        expansion rows (built and uploaded once per step, at its first layer); None: absorbed form."""
        if ctx.batch is None or ctx.decode_only or spec.v_dim > spec.qk_dim:
            return None
        if ctx.mla is None:
            host = expansion(ctx.batch, self.max_blocks, self.expand_cap)
            if host is None:
                ctx.mla = False
            else:
                rows, src, tables = host
                slots = self.buf["mla_x_slots"][:rows]
                dev_tables = self.buf["mla_x_tables"][:tables.size].reshape(tables.shape)
                slots.set(src, stream=self.shared.stream)
                dev_tables.set(tables, stream=self.shared.stream)
                ctx.mla = (rows, slots, dev_tables)
        return ctx.mla or None

    def _expanded(self, q, kv_b, spec: MLASpec, ctx, plan):
        rows, slots, tables = plan
        T, H, R, N, V, Dr, Dk = (ctx.num_tokens, spec.num_heads, spec.kv_lora_rank, spec.nope_dim, spec.v_dim,
                                 spec.rope_dim, spec.qk_dim)
        b, sh = self.buf, self.shared
        cache = sh.kv_cache[spec.layer, 0]
        latent = b["mla_x_latent"][:rows * R].reshape(rows, R)
        sh.launch(self.k_gather, (rows,), (64,), (cache, slots, latent, np.int32(R), np.int32(R + Dr))
                  + self._scale(spec.layer))
        kv = b["mla_x_kv"][:rows * H * (N + V)].reshape(rows, H * (N + V))
        sh.gemm(latent, kv_b, kv)
        k, v = b["mla_x_k"][:rows * H * Dk], b["mla_x_v"][:rows * H * Dk]
        sh.launch(self.k_expand, (rows,), (128,),
                  (kv, cache, slots, k, v, np.int32(H), np.int32(N), np.int32(V), np.int32(Dr), np.int32(R))
                  + self._scale(spec.layer))
        q_rot = sh.out(T, H * Dk)
        sh.launch(self.k_q_rope, (T,), (128,),
                  (q, sh.inv_freq, np.float32(sh.attention_factor), ctx.positions, q_rot, np.int32(H),
                   np.int32(N), np.int32(Dr)))
        self.dense.check_partials(T, H, ctx.num_splits)
        o_full = sh.out(T, H * Dk)
        self.dense.split_attention(q_rot, k, v, tables, H, H, Dk, spec.scale, ctx, o_full)
        o = sh.out(T, H * V)
        sh.launch(self.k_compact, (T,), (128,), (o_full, o, np.int32(H), np.int32(Dk), np.int32(V)))
        return o
