"""Multi-head latent attention Ops on the GPU, mixed into GpuOps (it provides gemm, kv_cache, inv_freq,
attention_factor, the activation ring, the paged-attention kernels and their split partials).

mla_latent_cache: mla_latent_cache.cu (latent RMSNorm + interleaved rope + the one-plane cache write,
and the query columns, RMSNorm'd when q_lora_rank is set). mla_attention picks the form per step:
  * absorbed (decode, and any step whose contexts do not fit the expansion rows): q_lat = W_UKᵀ·q_nope
    per head (one cuBLAS strided-batched GEMM reading kv_b_proj in place, float32 out), mla_decode.cu
    over the latent cache (one launch: its last split per head group merges the splits), o = W_UV·o_lat
    per head (a second strided-batched GEMM); steps of at most mla_absorb_tokens tokens can take
    mla_absorb.cu's two kernels for the projections instead (their weights read before the
    programmatic-launch wait). Graph-capturable: every grid depends on the token count alone.
  * expanded (eager steps with a prefill, contexts that fit): the context's latents gathered
    (mla_prefill.cu), one GEMM by kv_b_proj, K and V (V zero-padded to the key width) laid out in whole
    16-token blocks per sequence, and paged_attention.cu's kernels as plain multi-head attention.
"""
from __future__ import annotations

import ctypes

import numpy as np

from engine.executor.gpu_gemm import CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, \
    CUDA_R_32F
from engine.models.ops import MLASpec
from openinfer_kernels.raw_cuda import kernel
from openinfer_kernels.raw_cuda.launch import launch
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


def mla_decode_smem(rope_dim: int, kv_rank: int, group: int) -> int:
    """mla_decode.cu's dynamic shared memory: CHUNK bf16 latent rows and `group` float32 query rows."""
    row = kv_rank + rope_dim
    return MLA_CHUNK * row * 2 + group * row * 4


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
    mla_group = None                  # mla_decode.cu heads per CTA (None: mla_decode_shape; tests' A/B)
    # steps of at most this many tokens take mla_absorb.cu's projections instead of cuBLAS (0: never; up to
    # MLA_ABSORB_MAX_TOKENS): DeepSeek-V2-Lite's batch-1 graph step 1.250 -> 1.111 ms (moe.md, 2026-12-04 19:28).
    mla_absorb_tokens = 8

    @staticmethod
    def mla_buffers(plan) -> list[Buffer]:
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
    def mla_nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.mla_buffers(plan))

    def take_mla(self, arena, plan) -> None:
        """Carve the MLA buffers (none for another line) and check the kernels' limits."""
        s = plan.mla
        self.mla = None
        if s is None:
            return
        if s.kv_lora_rank % 8 or s.rope_dim % 8 or s.qk_dim > 256 or s.qk_dim % 2:
            raise ValueError(f"GPU MLA kernels need kv_lora_rank and qk_rope_head_dim % 8 == 0 and an even "
                             f"nope + rope <= 256; got {s}")
        self.mla = arena.take_all("mla", self.mla_buffers(plan))
        counters = self.mla["mla_counters"]       # zero between launches (the last split resets its own)
        self.cp.cuda.runtime.memsetAsync(counters.data.ptr, 0, counters.nbytes, self.stream.ptr)
        self.mla_expand_cap = expand_rows(plan)
        self.mla_max_blocks = plan.max_blocks
        self.k_mla_cache = kernel("mla_latent_cache", "mla_latent_cache")
        def decode_kernel(early: int):
            k = kernel("mla_decode", "mla_decode_split", KV_RANK=s.kv_lora_rank, ROPE_DIM=s.rope_dim, EARLY_CHUNK=early)
            k.max_dynamic_shared_size_bytes = mla_decode_smem(s.rope_dim, s.kv_lora_rank, MLA_MAX_GROUP)
            return k
        self.k_mla_decode = decode_kernel(1)
        # Where q_lora_rank is unset, mla_absorb_q_cache writes the step's latent rows in the launch right
        # before the attention: that one reads its first rows after the programmatic-launch wait.
        self.k_mla_decode_late = decode_kernel(0) if s.q_cols == s.num_heads * s.qk_dim else None
        self.mla_absorb_fits = s.nope_dim <= 256 and s.kv_lora_rank <= 1024      # mla_absorb.cu MAX_ROWS, MAX_PIECES
        self.k_mla_absorb_q = kernel("mla_absorb", "mla_absorb_q")
        self.k_mla_absorb_o = kernel("mla_absorb", "mla_absorb_o")
        self.k_mla_absorb_q_cache = kernel("mla_absorb", "mla_absorb_q_cache")
        self.k_mla_gather = kernel("mla_prefill", "mla_gather_latent")
        self.k_mla_expand = kernel("mla_prefill", "mla_expand_kv")
        self.k_mla_q_rope = kernel("mla_prefill", "mla_q_rope")
        self.k_mla_compact = kernel("mla_prefill", "mla_compact_o")

    # ---- Ops -----------------------------------------------------------------------------------
    def mla_latent_cache(self, y, spec: MLASpec, ctx, kv_norm, q_norm=None):
        T = ctx.num_tokens
        q = self._out(T, spec.q_cols)
        self._launch(self.k_mla_cache, (T,), (128,),
                     (y, np.int32(spec.q_cols), np.int32(spec.kv_lora_rank), np.int32(spec.rope_dim), kv_norm,
                      np.uint64(0) if q_norm is None else q_norm, np.float32(spec.rms_eps), self.inv_freq,
                      np.float32(self.attention_factor), ctx.positions, ctx.slot_mapping,
                      self.kv_cache[spec.layer, 0], q))
        return q

    def mla_attention(self, q, kv_b, spec: MLASpec, ctx):
        plan = self._mla_expansion(spec, ctx)
        if plan is None:
            return self._mla_absorbed(q, kv_b, spec, ctx)
        return self._mla_expanded(q, kv_b, spec, ctx, plan)

    def mla_latent_attention(self, y, kv_b, spec: MLASpec, ctx, kv_norm):
        """q_lora_rank unset, a step of mla_absorb.cu's size in the absorbed form: mla_absorb_q_cache does the
        cache write and W_UK's absorption of q in one launch (then mla_decode.cu and W_UV as mla_attention);
        else the composition."""
        T, H, R = ctx.num_tokens, spec.num_heads, spec.kv_lora_rank
        if not self._mla_raw(T) or spec.q_cols != H * spec.qk_dim or self._mla_expansion(spec, ctx) is not None:
            return super().mla_latent_attention(y, kv_b, spec, ctx, kv_norm)
        q, q_lat = self._out(T, spec.q_cols), self.mla["mla_q_lat"][:T * H * R]
        launch(self.k_mla_absorb_q_cache, (-(-R // 64) + 1, H), (256,),
               (y, kv_b, q_lat, np.int32(T), np.int32(H), np.int32(spec.nope_dim), np.int32(spec.v_dim), np.int32(R),
                np.int32(spec.qk_dim), np.int32(spec.rope_dim), kv_norm, np.float32(spec.rms_eps), self.inv_freq,
                np.float32(self.attention_factor), ctx.positions, ctx.slot_mapping, self.kv_cache[spec.layer, 0], q),
               self.stream, pdl=self.pdl)
        return self._mla_absorbed(q, kv_b, spec, ctx, q_absorbed=True)

    def _mla_raw(self, tokens: int) -> bool:
        """Whether a step of `tokens` query rows takes mla_absorb.cu's projections."""
        return tokens <= min(self.mla_absorb_tokens, MLA_ABSORB_MAX_TOKENS) and self.mla_absorb_fits

    # ---- absorbed form ---------------------------------------------------------------------------
    def _mla_absorbed(self, q, kv_b, spec: MLASpec, ctx, q_absorbed: bool = False):
        """q_absorbed: q_lat already holds W_UKᵀ·q_nope (mla_absorb_q_cache)."""
        T, H, R, N, V = ctx.num_tokens, spec.num_heads, spec.kv_lora_rank, spec.nope_dim, spec.v_dim
        b, head = self.mla, (N + V) * R                     # kv_b's stride between heads, in values
        q_lat, o_lat = b["mla_q_lat"][:T * H * R], b["mla_o_lat"][:T * H * R]
        raw = self._mla_raw(T)
        # q_lat[t, h] = W_UK_hᵀ q_nope[t, h]: column-major q_latᵀ [R, T] = W_UK_hᵀ [R, N] · q_nopeᵀ [N, T]
        if raw and not q_absorbed:
            launch(self.k_mla_absorb_q, (-(-R // 64), H), (256,),
                   (q, kv_b, q_lat, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R),
                    np.int32(spec.qk_dim)), self.stream, pdl=self.pdl)
        elif not q_absorbed:
            self.strided_gemm(CUBLAS_OP_N, R, T, N, kv_b, 0, R, head, q, 0, H * spec.qk_dim, spec.qk_dim,
                              q_lat, H * R, R, H)
        S, G = mla_decode_shape(T, ctx.num_splits, H, self.num_sms)
        if T * S * H > b["mla_part_max"].shape[0]:
            S, G = 1, min(MLA_MAX_GROUP, H)
        G = min(self.mla_group, MLA_MAX_GROUP, H) if self.mla_group else G
        bt = ctx.block_tables
        launch(self.k_mla_decode_late if q_absorbed else self.k_mla_decode, (-(-H // G), S, T), (256,),
               (q_lat, q, np.int32(spec.qk_dim), np.int32(N), self.inv_freq, np.float32(self.attention_factor),
                self.kv_cache[spec.layer, 0], bt, np.int32(bt.shape[1]), ctx.token_seq, ctx.positions,
                b["mla_part_out"], b["mla_part_max"], b["mla_part_sum"], o_lat, b["mla_counters"], np.int32(H),
                np.int32(G), np.float32(spec.scale)),
               self.stream, pdl=self.pdl, shared_mem=mla_decode_smem(spec.rope_dim, R, G))
        # o[t, h] = W_UV_h o_lat[t, h]: column-major oᵀ [V, T] = (W_UV_h as [R, V])ᵀ · o_latᵀ [R, T]
        o = self._out(T, H * V)
        if raw:
            launch(self.k_mla_absorb_o, (-(-V // 8), H), (256,),
                   (o_lat, kv_b, o, np.int32(T), np.int32(H), np.int32(N), np.int32(V), np.int32(R)),
                   self.stream, pdl=self.pdl)
        else:
            self.strided_gemm(CUBLAS_OP_T, V, T, R, kv_b, N * R, R, head, o_lat, 0, H * R, R, o, H * V, V, H)
        return o

    def strided_gemm(self, op_a: int, m: int, n: int, k: int, a, a_off: int, lda: int, stride_a: int,
                     b, b_off: int, ldb: int, stride_b: int, c, ldc: int, stride_c: int, batch: int) -> None:
        """cuBLAS strided-batched GEMM, column-major: C_i [m, n] = op(A_i) · B_i for i < batch, A and B bf16
        (offsets and strides in values), C bf16 or float32 (from its dtype), fp32 accumulation."""
        ctype = CUDA_R_32F if c.dtype == np.float32 else CUDA_R_16BF
        g = self.gemm
        args = [op_a, CUBLAS_OP_N, m, n, k, g._alpha.ctypes.data, a.data.ptr + 2 * a_off, CUDA_R_16BF, lda, stride_a,
                b.data.ptr + 2 * b_off, CUDA_R_16BF, ldb, stride_b, g._beta.ctypes.data, c.data.ptr, ctype, ldc,
                stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT]
        if g.lib is None:
            with self.stream:           # CuPy binds the handle to its current stream at each call
                g._cublas.gemmStridedBatchedEx(g.handle, *args)
            return
        fn = g.lib.cublasGemmStridedBatchedEx
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        fn.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i]
        fn.restype = i
        g._check(fn(g.handle, *args), "cublasGemmStridedBatchedEx")

    # ---- expanded form ---------------------------------------------------------------------------
    def _mla_expansion(self, spec: MLASpec, ctx):
        """(rows, src_slots, tables) device views of an eager prefill step whose contexts fit the
        expansion rows (built and uploaded once per step, at its first layer); None: absorbed form."""
        if ctx.batch is None or ctx.decode_only or spec.v_dim > spec.qk_dim:
            return None
        if ctx.mla is None:
            host = expansion(ctx.batch, self.mla_max_blocks, self.mla_expand_cap)
            if host is None:
                ctx.mla = False
            else:
                rows, src, tables = host
                slots = self.mla["mla_x_slots"][:rows]
                dev_tables = self.mla["mla_x_tables"][:tables.size].reshape(tables.shape)
                slots.set(src, stream=self.stream)
                dev_tables.set(tables, stream=self.stream)
                ctx.mla = (rows, slots, dev_tables)
        return ctx.mla or None

    def _mla_expanded(self, q, kv_b, spec: MLASpec, ctx, plan):
        rows, slots, tables = plan
        T, H, R, N, V, Dr, Dk = (ctx.num_tokens, spec.num_heads, spec.kv_lora_rank, spec.nope_dim, spec.v_dim,
                                 spec.rope_dim, spec.qk_dim)
        b, cache = self.mla, self.kv_cache[spec.layer, 0]
        latent = b["mla_x_latent"][:rows * R].reshape(rows, R)
        self._launch(self.k_mla_gather, (rows,), (64,), (cache, slots, latent, np.int32(R), np.int32(R + Dr)))
        kv = b["mla_x_kv"][:rows * H * (N + V)].reshape(rows, H * (N + V))
        self.gemm(latent, kv_b, kv)
        k, v = b["mla_x_k"][:rows * H * Dk], b["mla_x_v"][:rows * H * Dk]
        self._launch(self.k_mla_expand, (rows,), (128,),
                     (kv, cache, slots, k, v, np.int32(H), np.int32(N), np.int32(V), np.int32(Dr), np.int32(R)))
        q_rot = self._out(T, H * Dk)
        self._launch(self.k_mla_q_rope, (T,), (128,),
                     (q, self.inv_freq, np.float32(self.attention_factor), ctx.positions, q_rot, np.int32(H),
                      np.int32(N), np.int32(Dr)))
        S = ctx.num_splits
        if T * H * S > self.part_max.shape[0]:
            raise ValueError(f"attention partials: {T} tokens x {S} splits x {H} heads exceed the buffer")
        o_full = self._out(T, H * Dk)
        self._launch(self.k_attn, (S, H, T), (128,),
                     (q_rot, k, v, tables, np.int32(tables.shape[1]), ctx.token_seq, ctx.positions, self.part_out,
                      self.part_max, self.part_sum, np.int32(H), np.int32(H), np.int32(Dk), np.float32(spec.scale)))
        self._launch(self.k_merge, (T * H,), (128,),
                     (self.part_out, self.part_max, self.part_sum, o_full, np.int32(S), np.int32(Dk)))
        o = self._out(T, H * V)
        self._launch(self.k_mla_compact, (T,), (128,), (o_full, o, np.int32(H), np.int32(Dk), np.int32(V)))
        return o
