"""GpuExecutor: wires a model line's forward to the GPU parts and runs steps. It sizes nothing itself:
each part states its bytes from the plan (gpu_plan.py), gpu_arena_sizes.py adds them up, the executor carves one arena
(weights, then the parts, then the KV pool from what is left, memory/kv_pool.py) and hands each part
its region. Every setting comes in ExecutorOptions (options.py; the kernel choices in its GpuTuning).

Parts: GpuOps (the model Ops: raw CUDA kernels, the GEMM library, the activation ring), Gemm
(cuBLAS / gemv.cu / the CuTe GEMM; a CuTe product is checked against float32 at start and cuBLAS
serves where that fails), StepInputs (the step's arrays in one static buffer), GpuSampler,
PrefillAttention (the CuTe varlen kernel for long prefill sequences, gpu_prefill.py) and DecodeGraphs
(decode steps replayed as CUDA graphs per batch-size bucket, gpu_graphs.py; a second set for steps with
LoRA adapters, gpu_lora_ops.py) and PiecewiseGraphs (prefill and mixed steps of up to
GpuTuning.eager_graph_tokens tokens as CUDA graphs per token bucket, attention launched between them,
gpu_piecewise.py; dense lines; larger eager steps launch kernel by kernel); for a line with per-sequence
state, its state slots (memory/state_slots.py, one per max_num_seqs) before the KV pool. The host KV
tier's copies (pinned slots, streams, layer-by-layer restores) are a part too, GpuHostCopies (gpu_host_copies.py);
what to copy when is the scheduler's (engine/host_tier.py). With speculative decoding
(options.num_speculative_tokens), GpuVerify accepts a verify step's drafts on the device (gpu_verify.py) and
VerifyGraphs replay verify steps (gpu_verify_graphs.py). `last_host_s`: the host time of the last step to its launch.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from engine.batch import ModelBatch, PromptLogprobResult, StepOutput
from engine.executor.base import DoneStep, ExecutorBase, PendingStep
from engine.executor.gpu_arena_sizes import SLACK_BYTES, ArenaSizes, arena_bytes, arena_sizes
from engine.executor.gpu_eagle3 import attach_gpu_eagle3, take_step_rows
from engine.executor.gpu_gemm import WORKSPACE_BYTES, Gemm
from engine.executor.gpu_graphs import DecodeGraphs, nvtx_range
from engine.executor.gpu_held_drafts import HeldDraftSlots
from engine.executor.gpu_host_copies import GpuHostCopies, compute_event, events_done, layers_landed, wait_events
from engine.executor.gpu_inputs import GpuStepContext, StepInputs
from engine.executor.gpu_kv_format import gpu_kv_format
from engine.executor.gpu_mapped_copy import MappedCopy
from engine.executor.gpu_ngram import attach_gpu_ngram
from engine.executor.gpu_ops import GpuOps
from engine.executor.gpu_piecewise import PiecewiseGraphs, eager_buckets
from engine.executor.gpu_plan import DeviceInfo, GpuPlan, gpu_plan
from engine.executor.gpu_prefill import PrefillAttention
from engine.executor.gpu_readback import Readback
from engine.executor.gpu_sampler import GpuSampler, needs_processing
from engine.executor.gpu_shared import GpuShared
from engine.executor.gpu_step_timer import StepTimer
from engine.executor.gpu_verify import GpuVerify, verifies
from engine.executor.gpu_verify_graphs import build_verify_graphs
from engine.executor.options import (DEFAULT_GEMV_MAX_M, DEFAULT_GEMV_MAX_M_CUTE, ExecutorOptions,
                                     parse_decode_kernels)
from engine.executor.verify_rows import verify_rows
from engine.loader import LoadedModel
from engine.executor.gpu_quant_moe import has_fp8_experts
from engine.executor.gpu_quant_ops import block_scaled_gate_up, quant_ops_class, upload_quantized
from engine.models.quant_experts import KEPT
from engine.models.rope import rope_inv_freq
from engine.sampling import prompt_logprobs
from memory.device_arena import DeviceArena
from memory.kv_pool import copy_pool_blocks, pool_blocks
from memory.state_slots import check_slots, state_buffers
from memory.streams import DeviceStreams
from memory.weight_upload import upload_weights

log = logging.getLogger(__name__)
KV_ITEMSIZE = 2                 # bf16 KV (FP8: 1, memory/kv_format.py)


class GpuExecutor(ExecutorBase):
    supports_host_tier = True
    # the scheduler's partial prefix hits (1 token computed, not up to 16) measured not to pay here: that one-token
    # step reads the whole context as a decode and is not overlapped (bench/results/prefix-ttft-gpu.md, 2026-12-04;
    # 21.3 against 17.4 ms at 32k). The block copies themselves work (tests/gpu/test_gpu_partial_hit.py).
    supports_block_copies = False
    supports_draft_verify = True    # verify steps: gpu_verify.py (sized by options.num_speculative_tokens)
    ops_class = GpuOps              # a tensor-parallel rank's executor runs its own (engine/parallel)
    supports_eagle3 = True          # an EAGLE-3 head drafts on the device (gpu_eagle3.py; the steps then eager)
    supports_device_ngram = True    # prompt lookup on the device, its drafts in each step's read-back (gpu_ngram.py)
    attach_ngram = attach_gpu_ngram
    spec_off_batch_size = 32        # no drafts from 32 running sequences on by default (speculative.py: why)
    draft = None                    # the attached head's Eagle3Draft
    graphs_class = DecodeGraphs

    def __init__(self, model: LoadedModel, options: ExecutorOptions):
        options.validate()
        options.validate_for_gpu()
        model.model.check_gpu_shapes()
        self.options, self.config, self.model = options, model.config, model.model
        self.vocab_size, self.max_model_len = model.config.vocab_size, options.max_model_len
        self.device = DeviceInfo.query()
        k = options.num_speculative_tokens            # DeepSeek-V4's rings: room for a verify step's rejected drafts
        room = k > 0 and self.model.make_room_for_drafts(k)     # Qwen3.5: arrays for its held drafts
        self.plan = replace(gpu_plan(options, model.model, self.device), fp8_experts=has_fp8_experts(model.weights))
        self.ops_class = quant_ops_class(model.weights, self.ops_class)
        self.kv_format = gpu_kv_format(options.kv_cache_dtype, model, self.plan)
        self.kv_itemsize = self.kv_format.itemsize(KV_ITEMSIZE)
        self.streams = DeviceStreams()
        self.stream = self.streams.compute
        sizes = arena_sizes(self.plan, model, self.ops_class)
        self.num_state_slots = sizes.num_state_slots
        self.arena = DeviceArena(arena_bytes(sizes, self.plan, self.kv_itemsize))
        lora_weights = self._upload_weights(model, sizes)
        self._take_parts(sizes)
        self._take_kv_pool(sizes)
        self._build_ops(lora_weights)
        self.rolls_back_state = room or self._hold_drafts(k)
        self._host_side()
        self._build_graphs()
        self.stream.synchronize()
        log.info("GPU executor on %s (%d SMs): %s", self.device.name, self.device.num_sms, self.gemm.describe())
        log.info("%s; %d KV blocks, %s", self.arena.summary(), self.num_kv_blocks, self.kv_format.describe("bf16"))

    def _upload_weights(self, model: LoadedModel, sizes: ArenaSizes) -> dict:
        """The weights into the arena (gate_up rows interleaved in blocks of 8 for gemv.cu's fused SiLU·up unless
        block-scaled FP8 ones are kept: gpu_quant_ops.py); returns each LoRA site's weight extended by the A rows."""
        self.gate_up_interleaved = self.config.intermediate_size % 8 == 0 and not block_scaled_gate_up(model.weights)
        extended: dict = {}
        interleave = lambda name: self.gate_up_interleaved and name.endswith("gate_up_proj")
        self.weights = upload_weights(self.arena, [(n, w) for n, w in model.weights.items() if not isinstance(w, KEPT)],
                                      self.streams, total_bytes=sizes.weights, progress=self.options.progress,
                                      interleave=interleave, extra_rows=lambda n: sizes.lora_rows.get(n, 0),
                                      extended=extended)
        self.weights.update(upload_quantized(self.arena, model.weights, self.stream, interleave))
        return extended

    def _take_parts(self, sizes: ArenaSizes) -> None:
        """The GEMM library, the rope table, the step inputs, the sampler, the prefill attention, the state slots."""
        plan, stream = self.plan, self.stream
        self.gemm = self._gemm(plan, sizes.cute_max_m, sizes.parts["gemm"] - WORKSPACE_BYTES)
        inv_freq, self.attention_factor = rope_inv_freq(self.config, self.model.rope_dim)
        self.inv_freq = self.arena.take("rope.inv_freq", inv_freq.shape, np.float32)
        self.inv_freq.set(inv_freq, stream=stream)
        self.inputs = StepInputs(self.arena, stream, plan.max_tokens, plan.max_seqs, plan.max_blocks,
                                 self.config.vocab_size, plan.max_model_len)
        self.sampler = GpuSampler(self.arena, plan.sample_rows, plan.vocab, stream)
        self.verify = GpuVerify(self.arena, plan.sample_rows, plan.max_seqs, self.sampler, stream
                                ) if self.options.num_speculative_tokens else None
        self.prefill = None if sizes.prefill_min is None else PrefillAttention(
            self.arena, stream, plan.max_tokens, plan.max_seqs, PrefillAttention.plan_key_rows(plan),
            plan.kv.heads, plan.kv.dim, sizes.prefill_min,
            group=plan.num_heads // plan.kv.heads if self.options.gpu.chunk_attention and not self.kv_format.fp8 else 0,
            kv_format=self.kv_format)
        self.state = (self.arena.take_all("state", state_buffers(sizes.state, sizes.num_state_slots))
                      if sizes.state is not None else None)

    def _take_kv_pool(self, sizes: ArenaSizes) -> None:
        """The KV pool from what is left once the ops take theirs (or exactly num_kv_blocks)."""
        plan = self.plan
        num_kv_blocks = self.options.num_kv_blocks
        if num_kv_blocks is None:
            num_kv_blocks = pool_blocks(plan.kv, self.kv_itemsize, self.arena.free_bytes - sizes.parts["ops"] - SLACK_BYTES)
        if num_kv_blocks < 1:
            raise MemoryError("no device memory left for the KV cache: raise gpu_memory_utilization "
                              "or lower max_num_batched_tokens")
        if num_kv_blocks < plan.max_blocks:
            log.warning("KV pool of %d blocks holds less than one max_model_len sequence (%d blocks)",
                        num_kv_blocks, plan.max_blocks)
        self.num_kv_blocks = int(num_kv_blocks)
        self.kv_block_bytes = plan.kv.block_bytes(self.kv_itemsize)
        self.kv_cache = self.arena.take("kv", plan.kv.pool_shape(self.num_kv_blocks),
                                        np.uint8 if self.kv_format.fp8 else np.uint16)

    def _build_ops(self, lora_weights: dict) -> None:
        """The ops over the parts every op family shares (GpuShared), their buffers carved last."""
        self.gemm.gemv_max_m = parse_decode_kernels(self.options.gpu.decode_kernels, self.default_gemv_rows())[1]
        shared = GpuShared.take(self.arena, self.plan, stream=self.stream, gemm=self.gemm, kv_cache=self.kv_cache,
                                inv_freq=self.inv_freq, attention_factor=self.attention_factor,
                                kv_format=self.kv_format,
                                gate_up_interleaved=self.gate_up_interleaved)
        lm_head = self.weights["embed_tokens" if self.config.tie_word_embeddings else "lm_head"]
        self.ops = self._ops(shared, lm_head.data.ptr, lora_weights)

    def _hold_drafts(self, k: int) -> bool:
        """Verify steps over Gated DeltaNet state: each step's held-draft codes go up with its inputs."""
        if not (k and self.ops.deltanet is not None and self.ops.deltanet.holds_drafts):
            return False
        self.inputs.held_codes = HeldDraftSlots(k).codes
        return True

    def _ops(self, shared: GpuShared, lm_head_ptr: int, lora_weights: dict) -> GpuOps:
        return self.ops_class(self.plan, shared, self.arena, lm_head_ptr, lora_weights=lora_weights, state=self.state)

    def _host_side(self) -> None:
        """Read-backs (and uploads while a restore copies: mapped_copy, no copy engine), the host KV tier,
        the step timer."""
        self.mapped_copy = MappedCopy(self.stream)
        self.host_copies = GpuHostCopies(self.kv_cache, self.options.host_kv_blocks, self.stream,
                                         self.options.gpu.async_host_tier, self.model.layerwise_restore
                                         ) if self.options.host_kv_blocks else None
        self.last_host_s, self._fed = 0.0, False
        self.readback = Readback(self.plan.sample_rows, self.stream, self.mapped_copy)
        self.timer = StepTimer(self.stream) if self.options.time_steps else None

    def _build_graphs(self) -> None:
        """Decode graphs (and a second set for steps with LoRA adapters: the same forward with lora_shrink /
        lora_expand), and the piecewise graphs of eager steps where the line takes them."""
        options, model = self.options, self.model
        graphs_on = options.cuda_graphs and model.cuda_graphs
        if options.cuda_graphs and not graphs_on:
            log.info("%s: eager steps only (the line's ops are not graph-capturable)", self.config.model_type)
        self.graphs = self._graphs() if graphs_on else None
        self.lora_graphs = self._graphs() if graphs_on and self.plan.lora_sites else None
        piecewise = graphs_on and options.tensor_parallel_size == 1 and model.piecewise_graphs
        buckets = eager_buckets(self.plan.max_tokens, options.gpu.eager_graph_tokens) if piecewise else []
        self.piecewise = PiecewiseGraphs(model, self.ops, self.weights, self.stream, buckets) if buckets else None
        self.verify_graphs = build_verify_graphs(self)

    def _gemm(self, plan: GpuPlan, cute_max_m: int, cute_bytes: int) -> Gemm:
        tuning = plan.options.gpu
        cublas_ws = self.arena.take("gemm.cublas_workspace", (WORKSPACE_BYTES,), np.uint8)
        cute_ws = self.arena.take("gemm.cute_workspace", (cute_bytes // 4,), np.float32) if cute_bytes else None
        gemm = Gemm(self.stream, cublas_ws, cute_max_m=cute_max_m,
                    gemv_unroll=(tuning.gemv_unroll, tuning.gemv_unroll_narrow), num_sms=plan.device.num_sms,
                    cute_workspace=cute_ws)
        gemm.prepare_cute(plan.max_tokens, plan.linear_shapes)
        return gemm

    def _graphs(self) -> DecodeGraphs:
        return self.graphs_class(self.model, self.ops, self.weights, self.sampler, self.upload, self.readback,
                                 self.stream, self.options.graph_sizes, pdl=self.options.gpu.pdl)

    # ---- the host KV tier's copies (gpu_host_copies.py) ------------------------------------------------
    @property
    def supports_async_copies(self) -> bool:
        return self.host_copies is not None and self.host_copies.async_copies

    def copy_blocks(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]],
                    through: list[tuple[int, int]] = ()):
        if self.host_copies is None:
            raise RuntimeError("copy_blocks: the host KV tier is not enabled (host_kv_blocks = 0)")
        return self.host_copies.copy_blocks(offloads, restores, through)

    copies_done, wait_copies = staticmethod(events_done), staticmethod(wait_events)

    def copy_fence(self):
        """An event after the copies queued so far on the compute stream; its synchronize is the wait."""
        return compute_event(self.stream).synchronize

    def _kv_landed(self, layerwise: bool) -> None:
        """Before a step: a restore's layers landed (GpuHostCopies.landed)."""
        if self.host_copies is not None:
            self.host_copies.landed(self.ops, layerwise)

    def _uploads_by_kernel(self, on: bool) -> None:
        """While a restore holds the H2D copy engine, the step's inputs go in by mapped_copy.cu (a memcpy
        would queue behind the restore: bench/copy_contention.py)."""
        mapped = self.mapped_copy if on else None
        self.inputs.mapped = mapped
        if self.prefill is not None:
            self.prefill.mapped = mapped

    def set_lora(self, slot: int, adapter) -> None:
        """Load a LoRA adapter into one of the options.max_loras slots (None: empty it), queued on the
        compute stream behind the steps already launched (gpu_lora_ops.py)."""
        if self.ops.lora is None:
            super().set_lora(slot, adapter)
        self.ops.lora.set_slot(slot, adapter)

    # ---- graph warm-up (the engine calls it while idle) -------------------------------------------
    def warm_up(self) -> bool:
        """Capture one decode graph not captured yet (greedy and sampling, every bucket, smallest
        first) on padded rows; False once there is none left. The engine calls this while it has
        no work, so captures happen before the first steps that need them, not during them."""
        self._kv_landed(layerwise=False)
        todo = [(graphs, lora, m) for graphs, lora in ((self.graphs, False), (self.lora_graphs, True),
                                                       (self.verify_graphs, False))
                if graphs is not None for m in graphs.missing()]
        if not todo:
            return self._warm_piecewise()
        graphs, lora, (b, sampling) = todo[0]
        rows = graphs.rows_of(b)
        with nvtx_range(f"warm up graph B={b}{' sampling' if sampling else ''}{' LoRA' if lora else ''}"):
            ctx = self.inputs.upload_padding(rows, self.ops.splits(rows, self.plan.kv.heads, self.max_model_len),
                                             seqs=b, sampled=rows)
            self._use_lora(np.full(rows, -1, np.int32) if lora else None, rows)
            graphs.warm(b, sampling, ctx)
        return len(todo) > 1 or bool(self.piecewise and self.piecewise.missing())

    def _warm_piecewise(self) -> bool:
        """Capture one eager-step bucket not captured yet (smallest first); False once there is none."""
        missing = self.piecewise.missing() if self.piecewise is not None else []
        if not missing:
            return False
        with nvtx_range(f"warm up eager graphs T={missing[0]}"):
            try:
                self._use_lora(None, missing[0])         # no adapter (a LoRA graph's warm-up may have left one on)
                self.piecewise.warm(missing[0], self.inputs.upload_padding(missing[0], 1, seqs=1))
            except Exception:
                self._drop_piecewise()
                return False
        return len(missing) > 1

    def _drop_piecewise(self) -> None:
        """A capture failed: eager steps launch kernel by kernel from now on (logged once)."""
        log.exception("piecewise graphs of eager steps disabled: a capture failed")
        self.piecewise = None
        try:
            self.stream.synchronize()
        except Exception:                   # a capture the failure left open: nothing queued to wait for
            log.warning("stream synchronize after the failed capture raised", exc_info=True)

    def default_gemv_rows(self) -> int:
        """The GEMV's row limit of "all" / "gemv": batch 1 only where the CuTe GEMM serves decode."""
        return DEFAULT_GEMV_MAX_M_CUTE if self.gemm.cute is not None else DEFAULT_GEMV_MAX_M

    # ---- steps ------------------------------------------------------------------------------------
    def upload(self, batch: ModelBatch, pad_to: int | None = None, pad_tokens: int | None = None) -> GpuStepContext:
        """The step's inputs on the device (checked first; a fed step's ids come from the sampler);
        eager steps also plan prefill attention."""
        fed = batch.fed_rows() if self._fed else 0
        self._fed = False
        self.inputs.check(batch, self.num_kv_blocks, skip_ids=fed)
        if self.num_state_slots:
            check_slots(batch.state_slots, self.num_state_slots)
        if batch.block_copies.size:                 # partial prefix hits: on the stream, before the step
            layers_landed(self.ops, self.stream)    # (a source block may be a restore still landing: all of it first)
            with self.stream:
                copy_pool_blocks(self.kv_cache, batch.block_copies)
        ctx = self.inputs.upload(batch, lambda T, ctx_len: self.ops.splits(T, self.plan.kv.heads, ctx_len), pad_to,
                                 fed_ids=(self.sampler.ids, fed) if fed else None, pad_tokens=pad_tokens)
        self._use_lora(batch.lora_slots, ctx.num_tokens)
        if pad_to is None:
            ctx.batch = batch
            if self.prefill is not None:
                ctx.prefill = self.prefill.step(batch)
        return ctx

    def _use_lora(self, token_slots, rows: int) -> None:
        """The step's token -> LoRA slot map (None: no adapter in the step) for the LoRA part; rows: the
        step's rows (a decode graph's bucket)."""
        if self.ops.lora is not None:
            self.ops.lora.use(token_slots, rows)
        elif token_slots is not None:
            raise ValueError("a step with LoRA adapters on an executor without LoRA slots (max_loras = 0)")

    def _hidden(self, batch: ModelBatch):
        """The step's final-normed hidden rows (the real rows first) and its context: replayed by token
        bucket where the piecewise graphs serve the step, else launched kernel by kernel."""
        pw, fed = self.piecewise, self._fed
        self._kv_landed(layerwise=True)
        # a restore in flight holds the H2D copy engine: the step's inputs go in by a kernel meanwhile
        self._uploads_by_kernel(self.ops.kv_layer_events is not None)
        try:
            if pw is not None and pw.serves(batch):
                ctx = self.upload(batch, pad_tokens=pw.bucket(batch.num_tokens))
                try:
                    return pw.forward(ctx), ctx
                except Exception:
                    self._drop_piecewise()
                    self._fed = fed             # the eager upload below takes the fed ids again
            ctx = self.upload(batch)
            self.ops.reset()
            return self.model.forward(self.ops, self.weights, ctx), ctx
        finally:
            self._uploads_by_kernel(False)
            layers_landed(self.ops, self.stream)

    def _logits_host(self, hidden, rows: np.ndarray) -> np.ndarray:
        """float32 logits of the given hidden rows, on the host, in chunks of the logits buffer."""
        out, chunk = [], self.plan.logit_rows
        for at in range(0, rows.size, chunk):
            picked = self.ops.gather_rows(hidden, self.inputs.upload_rows(rows[at:at + chunk]))
            out.append(self.model.compute_logits(self.ops, self.weights, picked).get(stream=self.stream))
        self.stream.synchronize()
        return np.concatenate(out) if out else np.zeros((0, self.vocab_size), np.float32)

    def forward_logits(self, batch: ModelBatch) -> np.ndarray:
        hidden, _ = self._hidden(batch)
        return self._logits_host(hidden, np.arange(batch.num_tokens, dtype=np.int32))

    supports_fed_steps = True

    def execute(self, batch: ModelBatch) -> StepOutput:
        return self.submit(batch).result()

    def submit(self, batch: ModelBatch, fed: bool = False) -> PendingStep:
        """Launch one step; it returns while the GPU runs it (its result() is the step's one sync),
        except an eager step with logit processing or prompt logprobs, which runs to the end here.
        fed: a step whose leading rows' input ids (placeholders, batch.fed_rows) are the sampled ids of
        the step queued just before it, row for row, taken on the device (the engine queues it before
        that step's ids reach the host); rows after them (prompts admitted with it) bring their own."""
        t0 = time.perf_counter()
        if self.timer is not None:
            self.timer.start()
        self._fed = fed
        graphs = next((g for g in (self.graphs if batch.lora_slots is None else self.lora_graphs,
                                   None if fed else self.verify_graphs) if g is not None and g.serves(batch)), None)
        if graphs is not None:
            self._kv_landed(layerwise=False)
            with nvtx_range(f"decode graph B={len(batch.seqs)}"):
                pending = graphs.launch(batch, t0)
            self.last_host_s, self.last_step_graphed = graphs.last_host_s, True
        else:
            self.last_step_graphed = False
            with nvtx_range(f"step T={batch.num_tokens}"):
                pending = self.launch_eager(batch)
            self.last_host_s = time.perf_counter() - t0
        if isinstance(pending, DoneStep) and self.readback.tap is not None:
            self.readback.tap([], None)     # sampled on the host side: the drafts the last tap queued are stale
        if self.timer is not None:
            self.timer.stop()
        return pending

    def last_gpu_ms(self) -> float | None:
        """GPU time of the last step (options.time_steps; read after its result())."""
        return None if self.timer is None else self.timer.elapsed_ms()

    def discard_step_times(self) -> None:
        if self.timer is not None:
            self.timer.clear()

    def launch_eager(self, batch: ModelBatch) -> PendingStep:
        """One step with per-kernel launches (prefill, mixed and verify steps; decode where graphs are off).
        Sampled rows with no logit processing run the decode graphs' sampling kernels (grammar rows: the
        masked tail) and come back through the readback, so the host goes on while the GPU runs the step
        (a verify step's rows accepted on the device first, gpu_verify.py)."""
        sampled = [s for s in batch.seqs if s.sample]
        drafts = verifies(self.verify, sampled)
        hidden, ctx = self._hidden(batch)
        if self.draft is not None:
            take_step_rows(self, batch)
        verify = verify_rows(sampled) if drafts else None        # the grammars' masks while the forward runs
        steps, bitmask = (verify.steps, verify.bitmask) if verify is not None else (sampled, None)
        want = [i for i, s in enumerate(batch.seqs) if s.want_prompt_logprobs and s.prompt_logprob_targets()]
        logits = None
        if sampled:
            rows = self.ops.gather_rows(hidden, ctx.sample_rows)
            logits = self.model.compute_logits(self.ops, self.weights, rows)
        if want or any(map(needs_processing, steps)):
            tokens = self.sampler.sample(logits, steps, bitmask) if sampled else []
            out = StepOutput(sampled=verify.accept(tokens) if verify is not None else tokens)
            if want:
                out.prompt_logprobs = self._prompt_logprobs(batch, want, hidden)
            return DoneStep(out)
        if not sampled:
            return DoneStep(StepOutput(sampled=[]))
        greedy = self.sampler.queue_rows(logits, steps, bitmask)
        if verify is not None:
            return self.verify.queue(verify, greedy, self.readback)
        return self.readback.queue(self.sampler, sampled, greedy)

    def attach_eagle3(self, head):
        self.draft = attach_gpu_eagle3(self, head)
        return self.draft

    def execute_eager(self, batch: ModelBatch) -> StepOutput:
        return self.launch_eager(batch).result()

    def _prompt_logprobs(self, batch: ModelBatch, want: list[int], hidden) -> list[PromptLogprobResult]:
        """Logprobs of each wanted sequence's prompt_logprob_targets (token_ids[1:], and the next prompt
        token where the step ends inside the prompt), all rows through one gather + lm_head pass."""
        targets = [batch.seqs[i].prompt_logprob_targets() for i in want]
        spans = [(int(batch.cu_seqlens[i]), len(t)) for i, t in zip(want, targets)]
        rows = np.concatenate([np.arange(q0, q0 + n, dtype=np.int32) for q0, n in spans])
        logits = self._logits_host(hidden, rows)
        results, at = [], 0
        for i, (_, n), target in zip(want, spans, targets):
            s = batch.seqs[i]
            lps, tops, ranks = prompt_logprobs(logits[at:at + n], target, s.params.prompt_logprobs or 0)
            at += n
            results.append(PromptLogprobResult(seq_id=s.seq_id, start_pos=s.start_pos, logprobs=lps,
                                               top_logprobs=tops, ranks=ranks))
        return results

    def close(self) -> None:
        self.stream.synchronize()
        self.gemm.close()
        self.weights = {}
        self.arena.close()
