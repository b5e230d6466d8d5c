"""The scheduler -> executor contract: one engine step's work and its results.

A step mixes prefill chunks and decodes. Each SeqStep feeds `token_ids` at positions
`start_pos ...` of one sequence; its KV lands in the paged cache through `block_table`
(16-token blocks: token at position p lives in slot block_table[p // 16] * 16 + p % 16).
Attention for those tokens covers positions [0, start_pos + len(token_ids)).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.request import SamplingParams

BLOCK_SIZE = 16


@dataclass
class SeqStep:
    seq_id: int
    token_ids: list[int]                # tokens fed this step (a prefill chunk, or one decode token)
    start_pos: int                      # tokens of this sequence already in the KV cache
    block_table: list[int]              # covers at least start_pos + len(token_ids) positions
    sample: bool                        # sample the next token after this step (decode / last chunk)
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_len: int = 0                 # penalties count prompt tokens (repetition) ...
    history: list[int] = field(default_factory=list)  # ... and all tokens so far (prompt + output)
    num_generated: int = 0              # output tokens so far (min_tokens, per-step seeds)
    want_prompt_logprobs: bool = False  # return logprobs of token_ids[1:] given their prefix
    lora_id: int = 0

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class ModelBatch:
    """Flattened arrays the kernels consume, built once per step by `ModelBatch.build`."""
    seqs: list[SeqStep]
    input_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]: KV slot each new token writes
    cu_seqlens: np.ndarray       # int32 [B+1]: query offsets into the flattened tokens
    context_lens: np.ndarray     # int32 [B]: KV length each sequence attends to after this step
    block_tables: np.ndarray     # int32 [B, max_blocks], padded with 0
    sample_rows: np.ndarray      # int32 [S]: rows of the flattened tokens whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(len(s.token_ids) == 1 for s in self.seqs)

    @classmethod
    def build(cls, seqs: list[SeqStep]) -> "ModelBatch":
        ids, pos, slots, cu, ctx, rows = [], [], [], [0], [], []
        max_blocks = max((len(s.block_table) for s in seqs), default=1)
        tables = np.zeros((len(seqs), max(max_blocks, 1)), dtype=np.int32)
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"seq {s.seq_id}: empty step")
            need = -(-s.context_len // BLOCK_SIZE)
            if len(s.block_table) < need:
                raise ValueError(f"seq {s.seq_id}: block table has {len(s.block_table)} blocks, needs {need}")
            p = np.arange(s.start_pos, s.context_len, dtype=np.int32)
            table = np.asarray(s.block_table, dtype=np.int32)
            ids.append(np.asarray(s.token_ids, dtype=np.int32))
            pos.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            cu.append(cu[-1] + n)
            ctx.append(s.context_len)
            tables[i, : len(table)] = table
            if s.sample:
                rows.append(cu[-1] - 1)
        return cls(
            seqs=seqs,
            input_ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
            positions=np.concatenate(pos) if pos else np.zeros(0, np.int32),
            slot_mapping=np.concatenate(slots).astype(np.int32) if slots else np.zeros(0, np.int32),
            cu_seqlens=np.asarray(cu, dtype=np.int32),
            context_lens=np.asarray(ctx, dtype=np.int32),
            block_tables=tables,
            sample_rows=np.asarray(rows, dtype=np.int32),
        )


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None                          # of the sampled token (when asked)
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptLogprobResult:
    seq_id: int
    start_pos: int                                        # logprobs[i] is of token at start_pos + 1 + i
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass
class StepOutput:
    sampled: list[SampledToken]                           # one per SeqStep with sample=True, in order
    prompt_logprobs: list[PromptLogprobResult] = field(default_factory=list)
