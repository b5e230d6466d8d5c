"""GpuExecutor: a model line's forward over GpuOps (CuPy arrays, raw CUDA kernels, cuBLAS / CuTe
GEMMs), the same 16-token paged KV layout as the CPU executor ([slots, Hkv, D] per layer and K/V),
and the GPU sampler. All device memory is one arena: weights, activations, then the KV pool.
Decode-only steps replay a CUDA graph per batch-size bucket (gpu_graphs.py); prefill and mixed steps
run eagerly. `last_host_s` is the host time of the last step up to its launch (batch upload included).

Decode kernels (`decode_kernels`, default from $OPENINFER_DECODE_KERNELS, default "all"): a comma list of
"attention" (paged_decode.cu: bandwidth-shaped decode attention) and "gemv" or "gemv:M" (gemv.cu for
linear layers of at most M rows, with the RMSNorm / SiLU fused; default 8, or 1 where the CuTe GEMM
serves decode); "all" is both. "none": the split attention of paged_attention.cu and the GEMM library
serve every step. "all" is the default since its H200 check (bench/results/decode.md, 2026-11-30):
same gate results, Qwen3-4B batch 1 4.21 -> 3.66 ms/step.

GEMM library (`use_cute`, default from $OPENINFER_GEMM, default "auto"; gpu_gemm.cute_rows): "auto"
runs the bf16 products of at most 128 rows (decode batches) on the CuTe GEMM where kernels/cute is
built, cuBLAS the rest; "cute" every bf16 product; "cublas" none. A CuTe product checked at start-up
(Gemm.prepare_cute) must match a float32 reference, else cuBLAS serves; the startup log says which serves.

Decode graphs launch their kernels as programmatic dependent launches (kernels/raw_cuda/launch.py)
unless $OPENINFER_PDL is "0". $OPENINFER_LAYER_RANGES=1 adds an NVTX range per decoder layer to
eager steps, "ops" also one per op inside it (run with use_cuda_graphs off to see decode that way).

Prefill attention (`prefill_attention`, default from $OPENINFER_PREFILL_ATTENTION, default "cute"): in
eager steps, sequences of many new tokens run the CuTe varlen FlashAttention kernel over gathered K/V
(gpu_prefill.py); "paged" keeps every step on the paged kernels."""
from __future__ import annotations

import logging
import os
import time

import ml_dtypes
import numpy as np

from engine.batch import BLOCK_SIZE, ModelBatch, PromptLogprobResult, StepOutput
from engine.executor.base import DoneStep, PendingStep
from engine.executor.gpu_gemm import WORKSPACE_BYTES, Gemm, cute_rows, interleave_gate_up
from engine.executor.gpu_graphs import DecodeGraphs, nvtx_range
from engine.executor.gpu_ops import NUM_SMS, RING_SLOTS, GpuOps, GpuStepContext
from engine.executor.gpu_prefill import PrefillAttention, prefill_min_query
from engine.executor.gpu_sampler import MAX_TOP_LOGPROBS, PENALTY_ENTRIES, GpuSampler
from engine.loader import LoadedModel
from engine.models.rope import rope_inv_freq
from engine.sampling import prompt_logprobs
from memory.device_arena import DeviceArena, arena_budget
from memory.host_kv_copy import gpu_host_kv_copy
from memory.streams import DeviceStreams, pinned_array
from memory.weight_upload import upload_weights

log = logging.getLogger(__name__)
SLACK_BYTES = 64 << 20
DECODE_KERNELS_ENV = "OPENINFER_DECODE_KERNELS"
DEFAULT_DECODE_KERNELS = "all"
# Batches above 8 take cuBLAS: the GEMV's two n8 tiles made Qwen3-4B batch 12 / 16 steps 4.97 / 5.04 ms
# against 4.00 / 3.99 with cuBLAS (H200, 2026-12-01 04:50 UTC, bench/results/decode.md).
DEFAULT_GEMV_MAX_M = 8
# With the CuTe GEMM the GEMV keeps batch 1 only: Qwen3-8B batch 1 4.81 ms against 4.98 on CuTe, but
# batch 2 / 4 / 8 4.90 / 5.07 / 5.41 against 4.88 / 4.98 / 5.06 (Qwen3-4B: 3.24-3.34 on CuTe at
# batches 1-8 against 3.34-3.83; H200, 2026-12-01 21:17 UTC).
DEFAULT_GEMV_MAX_M_CUTE = 1
PDL_ENV = "OPENINFER_PDL"
LAYER_RANGES_ENV = "OPENINFER_LAYER_RANGES"


def parse_decode_kernels(spec: str, default_rows: int = DEFAULT_GEMV_MAX_M) -> tuple[bool, int]:
    """"attention,gemv:16" -> (fast attention on, GEMV for at most 16 rows); "" -> (False, 0);
    "all" and a bare "gemv" give the GEMV ``default_rows``."""
    fast, gemv_m = False, 0
    for item in (x.strip().lower() for x in spec.split(",")):
        if item in ("", "none", "0", "off"):
            continue
        if item in ("all", "1", "on"):
            fast, gemv_m = True, default_rows
        elif item == "attention":
            fast = True
        elif item == "gemv" or item.startswith("gemv:"):
            try:
                gemv_m = int(item[5:]) if ":" in item else default_rows
            except ValueError:
                raise ValueError(f"decode kernels: bad row limit in {item!r} (want gemv:N)") from None
        else:
            raise ValueError(f"decode kernels: unknown item {item!r} (want attention, gemv[:N], all)")
    return fast, gemv_m


def as_bf16(a: np.ndarray) -> np.ndarray:
    return a if a.dtype.name == "bfloat16" else np.asarray(a).astype(ml_dtypes.bfloat16)


class GpuExecutor:
    def __init__(self, model: LoadedModel, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256, use_cute: bool | str | None = None,
                 progress: bool = True, use_cuda_graphs: bool = True, decode_kernels: str | None = None,
                 prefill_attention: str | None = None):
        cfg = model.config
        self.config, self.model = cfg, model.model
        self.vocab_size = cfg.vocab_size
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        self.max_tokens = max(int(max_num_batched_tokens), int(max_num_seqs))
        self.max_seqs = int(max_num_seqs)
        self.max_blocks = -(-self.max_model_len // BLOCK_SIZE)
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        Hq, Hkv, L, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers, cfg.vocab_size
        if H % 8 or I % 8 or D % 2 or D > 256 or Hq % Hkv or Hq // Hkv > 16:
            raise ValueError(f"GPU kernels need hidden % 8 == 0 (got {H}), intermediate % 8 == 0 (got {I}), "
                             f"an even head_dim <= 256 (got {D}), heads/kv_heads <= 16 (got {Hq}/{Hkv})")
        self.streams = DeviceStreams()
        stream = self.streams.compute
        max_width = max(2 * I, (Hq + 2 * Hkv) * D, H)
        n_inputs = 5 * self.max_tokens + self.max_seqs * self.max_blocks
        prefill_min = prefill_min_query(prefill_attention, D)      # None: paged attention serves every step
        prefill_rows = self.max_model_len + self.max_tokens          # gathered K/V rows (gpu_prefill.py)
        prefill_bytes = 0 if prefill_min is None else PrefillAttention.nbytes(
            prefill_rows, Hkv, D, self.max_tokens, self.max_seqs)
        act_bytes = (RING_SLOTS * self.max_tokens * max_width * 2 + self.max_tokens * H * 2
                     + self.max_tokens * V * 4
                     + (self.max_tokens + 2 * NUM_SMS) * Hq * (D + 2) * 4 + self.max_tokens * Hq * 4
                     + 2 * self.max_seqs * V * 4 + 4 * PENALTY_ENTRIES * 4
                     + self.max_seqs * (MAX_TOP_LOGPROBS * 8 + 64) + n_inputs * 4 + WORKSPACE_BYTES
                     + prefill_bytes)
        weight_bytes = sum(int(a.size) * 2 for a in model.weights.values())
        block_bytes = L * 2 * BLOCK_SIZE * Hkv * D * 2
        if num_kv_blocks is None:
            arena_bytes = arena_budget(gpu_memory_utilization)
        else:
            arena_bytes = weight_bytes + act_bytes + int(num_kv_blocks) * block_bytes + SLACK_BYTES
        self.arena = DeviceArena(arena_bytes)
        # gate_up weights go up with gate and up rows interleaved in blocks of 8 (gemv.cu's fused SiLU·up)
        interleave = cfg.intermediate_size % 8 == 0
        layout = (lambda n, a: interleave_gate_up(a) if interleave and n.endswith("gate_up_proj") else a)
        self.weights = upload_weights(self.arena, ((n, layout(n, as_bf16(a))) for n, a in model.weights.items()),
                                      self.streams, total_bytes=weight_bytes, progress=progress)
        workspace = self.arena.take("activations.cublas_workspace", (WORKSPACE_BYTES,), np.uint8)
        self.gemm = Gemm(stream, workspace, cute_max_m=cute_rows(use_cute))
        self.gemm.prepare_cute(self.max_tokens, [w.shape for n, w in self.weights.items()  # bf16-output products
                                                 if w.ndim == 2 and n not in ("embed_tokens", "lm_head")])
        fast_attention, self.gemm.gemv_max_m = parse_decode_kernels(
            os.environ.get(DECODE_KERNELS_ENV, DEFAULT_DECODE_KERNELS) if decode_kernels is None else decode_kernels,
            self.default_gemv_rows())
        log.info("%s", self.gemm.describe())
        inv_freq, attention_factor = rope_inv_freq(cfg)
        self.inv_freq = self.arena.take("activations.inv_freq", inv_freq.shape, np.float32)
        self.inv_freq.set(inv_freq, stream=stream)
        self.inputs = self.arena.take("activations.step_inputs", (n_inputs,), np.int32)
        self.inputs_host = pinned_array((n_inputs,), np.int32)
        self.extra_rows = self.arena.take("activations.extra_rows", (self.max_tokens,), np.int32)
        lm_head = self.weights["embed_tokens" if cfg.tie_word_embeddings else "lm_head"]
        sampler_rows = self.max_seqs
        # The KV pool takes what is left (or exactly num_kv_blocks).
        kv_reserve = act_bytes - WORKSPACE_BYTES
        if num_kv_blocks is None:
            num_kv_blocks = (self.arena.free_bytes - kv_reserve - SLACK_BYTES) // block_bytes
        if num_kv_blocks < self.max_blocks:
            log.warning("KV pool of %d blocks holds less than one max_model_len sequence (%d blocks)",
                        num_kv_blocks, self.max_blocks)
        if num_kv_blocks < 1:
            raise MemoryError("no device memory left for the KV cache: raise gpu_memory_utilization")
        self.num_kv_blocks = int(num_kv_blocks)
        self.kv_cache = self.arena.take("kv", (L, 2, self.num_kv_blocks * BLOCK_SIZE, Hkv, D), np.uint16)
        self.ops = GpuOps(self.arena, self.gemm, self.kv_cache, self.inv_freq, attention_factor,
                          self.max_tokens, max_width, H, V, self.max_tokens, Hq, D, lm_head.data.ptr, stream,
                          fast_attention=fast_attention)
        ranges = os.environ.get(LAYER_RANGES_ENV, "0")
        self.ops.layer_ranges, self.ops.op_ranges = ranges in ("1", "ops"), ranges == "ops"
        self.ops.gate_up_interleaved = interleave
        self.pdl_decode = os.environ.get(PDL_ENV, "1") != "0"
        self.prefill = None if prefill_min is None else PrefillAttention(
            self.arena, stream, self.max_tokens, self.max_seqs, prefill_rows, Hkv, D, prefill_min)
        self.sampler = GpuSampler(self.arena, sampler_rows, V, stream)
        self.stream = stream
        self.last_host_s = 0.0
        self.graphs = DecodeGraphs(self) if use_cuda_graphs else None
        stream.synchronize()
        log.info("%s; %d KV blocks", self.arena.summary(), self.num_kv_blocks)

    def enable_host_tier(self, num_slots: int) -> None:
        """Host KV tier storage: num_slots pinned host blocks mirroring the KV pool (memory/host_kv_copy.py)."""
        self.host_kv = gpu_host_kv_copy(self.kv_cache, num_slots, self.stream)
        log.info("host KV tier: %d blocks, %.2f GiB pinned", num_slots, num_slots * self.host_kv.block_bytes / 2**30)

    def copy_blocks(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """offloads (device block -> host slot), then restores (host slot -> device block), queued on
        the compute stream ahead of the next step; the host does not wait for them."""
        host_kv = getattr(self, "host_kv", None)
        if host_kv is None:
            raise RuntimeError("copy_blocks: the host KV tier is not enabled (enable_host_tier first)")
        host_kv.copy_blocks(offloads, restores)

    def default_gemv_rows(self) -> int:
        """The GEMV's row limit of "all" / "gemv": batch 1 only where the CuTe GEMM serves decode."""
        return DEFAULT_GEMV_MAX_M_CUTE if self.gemm.cute is not None else DEFAULT_GEMV_MAX_M

    def set_decode_kernels(self, spec: str) -> None:
        """Switch the decode kernels (see the module docstring) between steps; drops captured graphs."""
        fast_attention, gemv_max_m = parse_decode_kernels(spec, self.default_gemv_rows())
        self.stream.synchronize()
        self.ops.fast_attention, self.gemm.gemv_max_m = fast_attention, gemv_max_m
        if self.graphs is not None:
            self.graphs = DecodeGraphs(self)

    # ---- step inputs -------------------------------------------------------------------------
    def _context(self, batch: ModelBatch, pad_to: int | None = None) -> GpuStepContext:
        """Upload the step's arrays into the static input buffer. pad_to (decode graphs): pad a
        one-token-per-sequence batch to that many rows; padded rows have position and slot -1
        (attention skips them, no KV is written) and read block-table row 0."""
        T, B = batch.num_tokens, len(batch.seqs)
        if T == 0 or T > self.max_tokens:
            raise ValueError(f"step has {T} tokens; the GPU executor takes 1..{self.max_tokens}")
        if B > self.max_seqs:
            raise ValueError(f"step has {B} sequences, more than max_num_seqs={self.max_seqs}")
        if int(batch.positions.max()) >= self.max_model_len:
            raise ValueError(f"position {int(batch.positions.max())} is beyond max_model_len {self.max_model_len}")
        if int(batch.block_tables.max()) >= self.num_kv_blocks:
            raise ValueError(f"block id {int(batch.block_tables.max())} is outside the KV pool "
                             f"({self.num_kv_blocks} blocks)")
        if batch.input_ids.min() < 0 or batch.input_ids.max() >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        Tm, mb = self.max_tokens, self.max_blocks
        h = self.inputs_host
        lens = np.diff(batch.cu_seqlens)
        h[0:T] = batch.input_ids
        h[Tm:Tm + T] = batch.positions
        h[2 * Tm:2 * Tm + T] = batch.slot_mapping
        h[3 * Tm:3 * Tm + T] = np.repeat(np.arange(B, dtype=np.int32), lens)
        S = batch.sample_rows.shape[0]
        h[4 * Tm:4 * Tm + S] = batch.sample_rows
        rows = B
        if pad_to is not None:
            h[T:pad_to], h[Tm + T:Tm + pad_to], h[2 * Tm + T:2 * Tm + pad_to] = 0, -1, -1
            h[3 * Tm + T:3 * Tm + pad_to] = 0
            h[4 * Tm:4 * Tm + pad_to] = np.arange(pad_to, dtype=np.int32)
            T = S = rows = pad_to
        tables = h[5 * Tm:5 * Tm + rows * mb].reshape(rows, mb)
        tables[:B, :batch.block_tables.shape[1]] = batch.block_tables
        tables[:B, batch.block_tables.shape[1]:] = 0
        tables[B:] = 0
        n = 5 * Tm + rows * mb
        import cupy
        cupy.cuda.runtime.memcpyAsync(self.inputs.data.ptr, h.ctypes.data, n * 4,
                                      cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        ctx = self._views(T, rows, S, int(batch.context_lens.max()) if pad_to is None else self.max_model_len)
        if pad_to is None and self.prefill is not None:
            ctx.prefill = self.prefill.step(batch)
        return ctx

    def _views(self, T: int, B: int, S: int, max_context: int) -> GpuStepContext:
        Tm, mb, d = self.max_tokens, self.max_blocks, self.inputs
        splits = self.ops.splits(T, self.config.num_key_value_heads, max_context)
        return GpuStepContext(num_tokens=T, input_ids=d[0:T], positions=d[Tm:Tm + T],
                              slot_mapping=d[2 * Tm:2 * Tm + T], token_seq=d[3 * Tm:3 * Tm + T],
                              block_tables=d[5 * Tm:5 * Tm + B * mb].reshape(B, mb),
                              sample_rows=d[4 * Tm:4 * Tm + S], num_splits=splits)

    def _hidden(self, batch: ModelBatch):
        ctx = self._context(batch)
        self.ops.reset()
        return self.model.forward(self.ops, self.weights, ctx), ctx

    # ---- Executor ----------------------------------------------------------------------------
    def forward_logits(self, batch: ModelBatch) -> np.ndarray:
        hidden, _ = self._hidden(batch)
        logits = self.model.compute_logits(self.ops, self.weights, hidden)
        out = logits.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def execute(self, batch: ModelBatch) -> StepOutput:
        return self.submit(batch).result()

    def submit(self, batch: ModelBatch) -> PendingStep:
        """Launch one step. A greedy decode-graph step returns while the GPU runs it (its result()
        is the step's one sync); other steps run to the end here."""
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.serves(batch):
            with nvtx_range(f"decode graph B={len(batch.seqs)}"):
                pending = self.graphs.launch(batch, t0)
            self.last_host_s = self.graphs.last_host_s
            return pending
        with nvtx_range(f"step T={batch.num_tokens}"):
            out = self._execute_eager(batch)
        self.last_host_s = time.perf_counter() - t0
        return DoneStep(out)

    def _execute_eager(self, batch: ModelBatch) -> StepOutput:
        hidden, ctx = self._hidden(batch)
        out = StepOutput(sampled=[])
        sampled = [s for s in batch.seqs if s.sample]
        if sampled:
            rows = self.ops.gather_rows(hidden, ctx.sample_rows)
            logits = self.model.compute_logits(self.ops, self.weights, rows)
            out.sampled = self.sampler.sample(logits, sampled)
        want = [i for i, s in enumerate(batch.seqs) if s.want_prompt_logprobs and len(s.token_ids) > 1]
        if want:
            out.prompt_logprobs = self._prompt_logprobs(batch, want, hidden)
        return out

    def _prompt_logprobs(self, batch: ModelBatch, want: list[int], hidden) -> list[PromptLogprobResult]:
        """Logprobs of token_ids[1:] of each wanted sequence, all rows in one gather + lm_head."""
        spans = [(int(batch.cu_seqlens[i]), len(batch.seqs[i].token_ids) - 1) for i in want]
        rows = np.concatenate([np.arange(q0, q0 + n, dtype=np.int32) for q0, n in spans])
        self.extra_rows[: rows.size].set(rows, stream=self.stream)
        picked = self.ops.gather_rows(hidden, self.extra_rows[: rows.size])
        logits = self.model.compute_logits(self.ops, self.weights, picked).get(stream=self.stream)
        self.stream.synchronize()
        results, at = [], 0
        for i, (_, n) in zip(want, spans):
            s = batch.seqs[i]
            lps, tops = prompt_logprobs(logits[at:at + n], s.token_ids[1:], s.params.prompt_logprobs or 0)
            at += n
            results.append(PromptLogprobResult(seq_id=s.seq_id, start_pos=s.start_pos, logprobs=lps,
                                               top_logprobs=tops))
        return results

    def close(self) -> None:
        self.stream.synchronize()
        self.gemm.close()
        self.weights = {}
        self.arena.close()
