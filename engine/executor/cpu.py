"""CpuExecutor: runs a model line's forward with NumpyOps over the paged KV pool of memory/kv_pool.py
(float32 compute; weights upcast from their stored dtype, or first rounded to options.dtype
"bfloat16" / "float16" so the CPU sees the GPU's weights)."""
from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from engine.batch import ModelBatch, PromptLogprobResult, StepOutput
from engine.draft_rows import FINAL, HiddenKeeper
from engine.eagle3 import Eagle3Head
from engine.eagle3_draft import Eagle3Draft
from engine.executor.base import ExecutorBase
from engine.executor.cpu_cost import cpu_step_cost
from engine.executor.cpu_lora_ops import NumpyLoRAOps
from engine.executor.cpu_ops import CpuStepContext, NumpyOps
from engine.executor.cpu_quant_ops import host_fp8
from engine.executor.cpu_threads import CpuThreads, default_cpu_threads
from engine.executor.options import ExecutorOptions
from engine.loader import LoadedModel
from engine.loader.kv_scales import kv_format_of
from engine.lora import lora_sites
from engine.models.quant_experts import Fp8Experts, W4Experts, log_kept
from engine.models.quant_linear import Fp8Linear, W4Linear
from engine.models.rope import rope_cos_sin
from engine.mtp import MtpLayer
from engine.mtp_draft import MtpDraft
from engine.sampling import prompt_logprobs, sample_step
from memory.kv_pool import BLOCK_SIZE, blocks_for, check_block_copies, copy_pool_blocks, host_pool, pool_blocks
from memory.state_slots import check_slots, host_state

log = logging.getLogger(__name__)

DEFAULT_KV_BYTES = 1 << 30          # KV pool budget when num_kv_blocks is not given
ROUNDING = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CpuExecutor(ExecutorBase):
    supports_host_tier = True
    supports_block_copies = True
    supports_draft_verify = True    # engine/sampling.py verifies a step's draft rows
    supports_eagle3 = True          # an EAGLE-3 head drafts on the host (engine/eagle3_draft.py)
    supports_mtp = True             # the model's MTP layer drafts on the host (engine/mtp_draft.py)

    def __init__(self, model: LoadedModel, options: ExecutorOptions):
        options.validate()
        cfg = model.config
        self.options, self.model, self.config = options, model.model, cfg
        self.model_path = model.path
        self.vocab_size, self.max_model_len = cfg.vocab_size, options.max_model_len
        self.weights = self._prepared(model.weights)
        fp8, w4 = "W8A8 in numpy (the GPU kernels' numerics, cpu_quant_ops.py)", "numpy on the dequantized weights (W4A16)"
        log_kept(model.weights, {Fp8Linear: fp8, Fp8Experts: fp8, W4Linear: w4, W4Experts: w4})
        self.layout = self.model.kv_layout()
        self.kv_format = kv_format_of(options.kv_cache_dtype, model)
        itemsize = self.kv_format.itemsize(4)                      # the numpy pool is float32, or e4m3 bytes
        self.kv_block_bytes = self.layout.block_bytes(itemsize)
        self.step_cost = cpu_step_cost(cfg, self.weights, self.kv_block_bytes // BLOCK_SIZE)
        num_kv_blocks = options.num_kv_blocks
        if num_kv_blocks is None:
            need = blocks_for(self.max_model_len)
            num_kv_blocks = max(need, min(pool_blocks(self.layout, itemsize, DEFAULT_KV_BYTES), 8 * need))
        self.num_kv_blocks = int(num_kv_blocks)
        kv_dtype = self.kv_format.host_dtype()
        self.kv = host_pool(self.layout, self.num_kv_blocks, kv_dtype)
        self.host_kv = host_pool(self.layout, options.host_kv_blocks, kv_dtype) if options.host_kv_blocks else None
        log.info("%s; %d KV blocks", self.kv_format.describe("float32"), self.num_kv_blocks)
        self.cos, self.sin = rope_cos_sin(cfg, self.max_model_len, self.model.rope_dim)
        self.threads = CpuThreads(options.cpu_threads or default_cpu_threads())
        k = options.num_speculative_tokens
        room = k > 0 and self.model.make_room_for_drafts(k)      # DeepSeek-V4's rings: room for rejected drafts
        state = self.model.state_layout()          # lines with per-sequence state: one slot per sequence
        self.num_state_slots = options.max_num_seqs if state is not None else 0
        lora = NumpyLoRAOps(lora_sites(self.model), options.max_loras) if options.max_loras else None
        self.ops = self._ops(state, lora)
        self.rolls_back_state = room or self.ops.rolls_back_state     # Gated DeltaNet state: held drafts
        self.draft: Eagle3Draft | MtpDraft | None = None

    def attach_eagle3(self, head: Eagle3Head) -> Eagle3Draft:
        """Keep the hidden states `head` reads on every step from now on; the draft proposer over them."""
        self.draft = Eagle3Draft(head, self.weights["embed_tokens"], self.max_model_len)
        self.ops.keeper = HiddenKeeper(head.aux_layers)
        return self.draft

    def attach_mtp(self, mtp: MtpLayer) -> MtpDraft:
        """Keep the final-normed hidden states on every step from now on; the MTP layer's draft proposer over them."""
        self.draft = MtpDraft(self.model, mtp, self._prepared(mtp.weights), self.weights["embed_tokens"], self.cos,
                              self.sin)
        self.ops.keeper = HiddenKeeper({FINAL})
        return self.draft

    def _ops(self, state, lora: NumpyLoRAOps | None) -> NumpyOps:
        """The model's ops over the KV pool: its op families, its state slots, the LoRA slots (a
        tensor-parallel rank's executor builds its own, engine/parallel)."""
        return NumpyOps(self.kv, self.model.op_families, self._state_arrays(state), lora, self.kv_format)

    def _state_arrays(self, state) -> dict | None:
        """The per-sequence state slots of a line that declares state (memory/state_slots.py)."""
        return host_state(state, self.num_state_slots) if state is not None else None

    def set_lora(self, slot: int, adapter) -> None:
        """Load a LoRA adapter (engine/lora.py) into one of the options.max_loras slots (None: empty it)."""
        if self.ops.lora is None:
            super().set_lora(slot, adapter)
        self.ops.lora.set_slot(slot, adapter)

    def copy_blocks(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """offloads (device block -> host slot) first, then restores (host slot -> device block)."""
        if self.host_kv is None:
            raise RuntimeError("copy_blocks: the host KV tier is not enabled (host_kv_blocks = 0)")
        pool = self.kv.reshape(*self.kv.shape[:2], -1, BLOCK_SIZE, *self.kv.shape[3:])
        host = self.host_kv.reshape(*self.host_kv.shape[:2], -1, BLOCK_SIZE, *self.host_kv.shape[3:])
        for pairs, to_host in ((offloads, True), (restores, False)):
            if not pairs:
                continue
            src, dst = (np.array(x, np.int64) for x in zip(*pairs))
            if to_host:
                host[:, :, dst] = pool[:, :, src]
            else:
                pool[:, :, dst] = host[:, :, src]

    def _prepared(self, weights: dict) -> dict:
        """Each weight as the numpy ops read it (_prepare), rounded through the executor's dtype first."""
        rounding = ROUNDING.get(self.options.dtype)
        return {name: self._prepare(a, rounding) for name, a in weights.items()}

    @staticmethod
    def _prepare(a: np.ndarray, rounding) -> np.ndarray:
        """float32 in memory; matrices column-major, so `x @ w.T` reads w.T contiguously (3x faster gemv); a
        kept FP8 weight stays FP8 (its codes as float32 values: cpu_quant_ops.py), a kept int4 one is dequantized
        exactly (W4A16: the product is the dequantized weights')."""
        if isinstance(a, (Fp8Linear, Fp8Experts)):
            return host_fp8(a)
        if isinstance(a, (W4Linear, W4Experts)):
            a = a.dequantized()
        if rounding is not None and a.ndim >= 2:
            a = np.asarray(a).astype(rounding)
        a = np.asarray(a, dtype=np.float32)
        return np.asfortranarray(a) if a.ndim == 2 else np.array(a)

    def _context(self, batch: ModelBatch) -> CpuStepContext:
        self.threads.for_step(batch.num_tokens)
        if batch.num_tokens and int(batch.positions.max()) >= self.max_model_len:
            raise ValueError(f"position {int(batch.positions.max())} is beyond max_model_len {self.max_model_len}")
        if batch.block_tables.size and int(batch.block_tables.max()) >= self.num_kv_blocks:
            raise ValueError(f"block id {int(batch.block_tables.max())} is outside the KV pool "
                             f"({self.num_kv_blocks} blocks)")
        if batch.num_tokens and (batch.input_ids.min() < 0 or batch.input_ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        if self.num_state_slots:
            check_slots(batch.state_slots, self.num_state_slots)
        check_block_copies(batch.block_copies, self.num_kv_blocks)
        copy_pool_blocks(self.kv, batch.block_copies)
        self.ops.use_lora(batch.lora_slots)
        return CpuStepContext(batch, self.cos[batch.positions], self.sin[batch.positions])

    def _hidden(self, batch: ModelBatch) -> np.ndarray:
        hidden = self.model.forward(self.ops, self.weights, self._context(batch))
        if self.draft is not None:
            self.ops.keeper.keep(FINAL, hidden)
            self.draft.take(batch, self.ops.keeper.kept)
        return hidden

    def forward_logits(self, batch: ModelBatch) -> np.ndarray:
        """float32 logits [T, V] for every token (also writes the step's KV)."""
        return self.model.compute_logits(self.ops, self.weights, self._hidden(batch)).astype(np.float32)

    def execute(self, batch: ModelBatch) -> StepOutput:
        hidden = self._hidden(batch)
        sampled_seqs = [s for s in batch.seqs if s.sample]
        rows = self.ops.gather_rows(hidden, batch.sample_rows)
        logits = self.model.compute_logits(self.ops, self.weights, rows).astype(np.float32)
        out = StepOutput(sampled=sample_step(logits, sampled_seqs) if sampled_seqs else [])
        for i, s in enumerate(batch.seqs):
            if s.want_prompt_logprobs:
                out.prompt_logprobs.append(self._prompt_logprobs(batch, i, hidden))
        return out

    def _prompt_logprobs(self, batch: ModelBatch, i: int, hidden: np.ndarray) -> PromptLogprobResult:
        s = batch.seqs[i]
        q0 = int(batch.cu_seqlens[i])
        targets = s.prompt_logprob_targets()
        rows = self.ops.gather_rows(hidden, np.arange(q0, q0 + len(targets)))
        logits = self.model.compute_logits(self.ops, self.weights, rows).astype(np.float32)
        lps, tops, ranks = prompt_logprobs(logits, targets, s.params.prompt_logprobs or 0)
        return PromptLogprobResult(seq_id=s.seq_id, start_pos=s.start_pos, logprobs=lps, top_logprobs=tops,
                                   ranks=ranks)
