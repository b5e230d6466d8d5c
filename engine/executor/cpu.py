"""CpuExecutor: runs a model line's forward with NumpyOps over a paged KV cache (float32
compute; weights upcast from their stored dtype, optionally rounded to bf16 like the GPU path)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from engine.batch import BLOCK_SIZE, ModelBatch, PromptLogprobResult, StepOutput
from engine.executor.cpu_ops import CpuStepContext, NumpyOps
from engine.loader import LoadedModel
from engine.models.rope import rope_cos_sin
from engine.sampling import prompt_logprobs, sample_step

DEFAULT_KV_BYTES = 1 << 30          # KV pool size when num_kv_blocks is not given


class CpuExecutor:
    def __init__(self, model: LoadedModel, num_kv_blocks: int | None = None,
                 max_model_len: int | None = None, bf16_weights: bool = False):
        cfg = model.config
        self.model = model.model
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        self.weights = {name: self._prepare(a, bf16_weights) for name, a in model.weights.items()}
        block_bytes = cfg.num_hidden_layers * 2 * BLOCK_SIZE * cfg.kv_size * 4
        if num_kv_blocks is None:
            need = -(-self.max_model_len // BLOCK_SIZE)
            num_kv_blocks = max(need, min(DEFAULT_KV_BYTES // block_bytes, 8 * need))
        self.num_kv_blocks = int(num_kv_blocks)
        shape = (self.num_kv_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = [np.zeros(shape, np.float32) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [np.zeros(shape, np.float32) for _ in range(cfg.num_hidden_layers)]
        self.cos, self.sin = rope_cos_sin(cfg, self.max_model_len)
        self.ops = NumpyOps(self.k_cache, self.v_cache)

    def enable_host_tier(self, num_slots: int) -> None:
        """Host KV tier storage (memory/host_tier.py): num_slots blocks of every layer's K and V."""
        shape = (num_slots,) + self.k_cache[0].shape[1:]
        self.k_host = [np.zeros(shape, np.float32) for _ in self.k_cache]
        self.v_host = [np.zeros(shape, np.float32) for _ in self.v_cache]

    def copy_blocks(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """offloads (device block -> host slot) first, then restores (host slot -> device block)."""
        for pairs, to_host in ((offloads, True), (restores, False)):
            if not pairs:
                continue
            src, dst = (np.array(x, np.int64) for x in zip(*pairs))
            for dev, host in ((self.k_cache, self.k_host), (self.v_cache, self.v_host)):
                for layer_dev, layer_host in zip(dev, host):
                    if to_host:
                        layer_host[dst] = layer_dev[src]
                    else:
                        layer_dev[dst] = layer_host[src]

    @staticmethod
    def _prepare(a: np.ndarray, bf16: bool) -> np.ndarray:
        """float32 in memory; matrices column-major, so `x @ w.T` reads w.T contiguously (3x faster gemv)."""
        if bf16 and a.ndim == 2:
            a = np.asarray(a).astype(ml_dtypes.bfloat16)
        a = np.asarray(a, dtype=np.float32)
        return np.asfortranarray(a) if a.ndim == 2 else np.array(a)

    def _context(self, batch: ModelBatch) -> CpuStepContext:
        if batch.num_tokens and int(batch.positions.max()) >= self.max_model_len:
            raise ValueError(f"position {int(batch.positions.max())} is beyond max_model_len {self.max_model_len}")
        if batch.block_tables.size and int(batch.block_tables.max()) >= self.num_kv_blocks:
            raise ValueError(f"block id {int(batch.block_tables.max())} is outside the KV pool "
                             f"({self.num_kv_blocks} blocks)")
        if batch.num_tokens and (batch.input_ids.min() < 0 or batch.input_ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        return CpuStepContext(batch, self.cos[batch.positions], self.sin[batch.positions])

    def _hidden(self, batch: ModelBatch) -> np.ndarray:
        return self.model.forward(self.ops, self.weights, self._context(batch))

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
        n = len(s.token_ids)
        rows = self.ops.gather_rows(hidden, np.arange(q0, q0 + n - 1))
        logits = self.model.compute_logits(self.ops, self.weights, rows).astype(np.float32)
        lps, tops = prompt_logprobs(logits, s.token_ids[1:], s.params.prompt_logprobs or 0)
        return PromptLogprobResult(seq_id=s.seq_id, start_pos=s.start_pos, logprobs=lps, top_logprobs=tops)

    def close(self) -> None:
        self.k_cache.clear()
        self.v_cache.clear()
