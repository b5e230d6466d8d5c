"""The scheduler -> executor contract: one engine step's work and its results.

A step mixes prefill chunks and decodes. Each SeqStep feeds `token_ids` at positions
`start_pos ...` of one sequence; its KV lands in the paged cache through `block_table`
(16-token blocks: token at position p lives in slot block_table[p // 16] * 16 + p % 16).
Attention for those tokens covers positions [0, start_pos + len(token_ids)).
`block_copies` are done first: a sequence that starts from part of a cached block (a partial prefix
hit) gets that block's KV copied into its own (every layer and plane) before the step writes there.
A line with per-sequence state (linear attention) reads and updates the sequence's `state_slot`
(memory/state_slots.py); a step that starts at position 0 starts from zero state. After a prefix hit such a
line may replay the hit's last tokens to rebuild that state (engine/seq_state.py): positions below a
step's `kv_from` have KV restored from the cache, so their `slot_mapping` is -1 (nothing written there).

Speculative decoding: a step may end in `num_drafts` draft tokens (a verify step: the sequence's last token,
then k drafts). Its last k + 1 rows are all sampled (sample_rows lists them, grouped by sequence) and
verified (engine/sampling.py verify_seq): the SampledToken is the token after the accepted drafts, its
`accepted` the accepted drafts, each with its own logprobs. The KV slots of rejected drafts are written
but never read: the scheduler counts only accepted positions as computed, and later steps overwrite them. A line
with per-sequence state is verified only by an executor that rolls it back (`rolls_back_state`): the sequence's
next step starts right after its accepted tokens, which tells the executor what to keep of the drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any

import numpy as np

from engine.request import SamplingParams
from memory.kv_pool import BLOCK_SIZE

__all__ = ["BLOCK_SIZE", "ModelBatch", "PromptLogprobResult", "SampledToken", "SeqStep", "StepOutput"]


@dataclass(slots=True)
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
    block_array: np.ndarray | None = None   # block_table as int32, when the caller keeps one
    state_slot: int = -1                # the sequence's state slot (-1: the line keeps no state)
    grammar: Any = None                     # structured output: the sequence's GrammarMatcher (engine/grammar.py)
    block_copy: tuple[int, int] | None = None   # (cached block, own block): copy its KV before this step writes
    num_drafts: int = 0                 # the last num_drafts of token_ids are draft tokens to verify (sample set)
    kv_from: int = 0                    # positions below it are replayed: their KV is restored, not written

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    def prompt_logprob_targets(self) -> list[int]:
        """The tokens whose prompt logprobs this step scores: token_ids[1:], and the next prompt token
        when the step ends inside the prompt and `history` holds it (its logprob needs this step's last
        row; a line with per-sequence state cannot re-feed that token in the next chunk)."""
        nxt = self.context_len
        more = nxt < self.prompt_len and nxt < len(self.history)
        return self.token_ids[1:] + ([self.history[nxt]] if more else [])


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
    sample_rows: np.ndarray      # int32 [S]: rows of the flattened tokens whose logits are sampled (1 +
                                 # num_drafts per sampled sequence, in order)
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 [B]
    lora_slots: np.ndarray | None = None   # int32 [T]: each token's LoRA adapter slot (-1: none); None: no adapter
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))  # int32 [C, 2] (src, dst)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == len(self.seqs)       # every step feeds >= 1 token (build checks)

    def fed_rows(self) -> int:
        """The leading rows of a step queued before the step ahead of it finished (async scheduling): one
        token each, its id the placeholder -1, taken on the device from that step's sampled ids row for
        row; the rows after them (prompts admitted with the plan) carry their own ids. ValueError where
        placeholders are not exactly such leading one-token rows."""
        placeholders = self.input_ids < 0
        fed = int(placeholders.sum())
        if fed == 0 or placeholders[fed:].any() or not placeholders[:fed].all() or len(self.seqs) < fed:
            raise ValueError("a fed step's placeholder ids (-1) must be its leading rows, one token each")
        if int(self.cu_seqlens[fed]) != fed:
            raise ValueError("a fed step's placeholder rows must be one-token rows")
        return fed

    @classmethod
    def build(cls, seqs: list[SeqStep], lora_slots: dict[int, int] | None = None) -> "ModelBatch":
        """A few Python passes over the steps for their sizes; the per-token and per-block arrays
        come from numpy (repeats of per-sequence offsets, one masked fill of the tables, from the
        steps' kept int32 tables when every step has one). lora_slots: lora id -> adapter slot of
        the steps' adapters (engine/lora_registry.py `prepare`; None: no step has one)."""
        B = len(seqs)
        lens = [len(s.token_ids) for s in seqs]
        starts = [s.start_pos for s in seqs]
        arrays = [s.block_array for s in seqs]
        kept = all(a is not None for a in arrays)       # the scheduler keeps int32 tables: no conversion
        widths = [len(a) for a in arrays] if kept else [len(s.block_table) for s in seqs]
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        copies = [s.block_copy for s in seqs if s.block_copy is not None]
        for s, n, w in zip(seqs, lens, widths):
            if n == 0 or w * BLOCK_SIZE < s.start_pos + n or _bad_drafts(s):
                _reject(s)
        cu = np.zeros(B + 1, np.int32)
        cu[1:] = list(accumulate(lens))
        T = int(cu[-1])
        width = max(widths, default=1) or 1
        tables = np.zeros((B, width), np.int32)
        if kept:
            flat = np.concatenate(arrays) if B else np.zeros(0, np.int32)
        else:
            flat = np.fromiter(chain.from_iterable(s.block_table for s in seqs), np.int32, sum(widths))
        if B and widths.count(width) == B:
            tables[:] = flat.reshape(B, width)
        elif B:
            tables[np.arange(width) < np.array(widths)[:, None]] = flat
        positions = np.array(starts, np.int32)
        if T == B:                                       # decode only: one token per sequence
            input_ids = np.fromiter((s.token_ids[0] for s in seqs), np.int32, B)
            rows = np.arange(B)
        else:
            input_ids = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), np.int32, T)
            rows = np.repeat(np.arange(B), lens)
            positions = np.arange(T, dtype=np.int32) + np.repeat(positions - cu[:-1], lens)
        return cls(
            seqs=seqs,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=_unless_replayed(tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
                                          positions, seqs, lens, T),
            cu_seqlens=cu,
            context_lens=cu[1:] - cu[:-1] + np.array(starts, np.int32),
            block_tables=tables,
            sample_rows=_sample_rows(cu[1:][sampled], [seqs[i].num_drafts for i in sampled]),
            state_slots=np.fromiter((s.state_slot for s in seqs), np.int32, B),
            lora_slots=None if lora_slots is None else np.repeat(
                np.array([lora_slots.get(s.lora_id, -1) for s in seqs], np.int32), lens),
            block_copies=np.array(copies, np.int32) if copies else np.zeros((0, 2), np.int32),
        )


def _unless_replayed(slots: np.ndarray, positions: np.ndarray, seqs: list[SeqStep], lens: list[int],
                     T: int) -> np.ndarray:
    """The KV slots of a step, -1 at the replayed positions (below a step's kv_from: restored by a prefix hit
    and recomputed only for the sequence's state, its KV not written again)."""
    if T != len(seqs) and any(s.kv_from > s.start_pos for s in seqs):
        slots[positions < np.repeat(np.array([s.kv_from for s in seqs], np.int32), lens)] = -1
    return slots


def _sample_rows(ends: np.ndarray, drafts: list[int]) -> np.ndarray:
    """The sampled rows: the last 1 + drafts[i] rows before ends[i] of each sampled sequence."""
    if not any(drafts):
        return ends - 1
    counts = np.asarray(drafts, np.int32) + 1
    firsts = np.cumsum(counts) - counts
    return (np.repeat(ends - counts, counts) + np.arange(int(counts.sum())) - np.repeat(firsts, counts)).astype(np.int32)


def _bad_drafts(s: SeqStep) -> bool:
    """Draft tokens a step cannot carry: negative, or not fewer than its tokens of a sampled step."""
    return s.num_drafts < 0 or (s.num_drafts > 0 and not (s.sample and s.num_drafts < len(s.token_ids)))


def _reject(s: SeqStep) -> None:
    if not s.token_ids:
        raise ValueError(f"seq {s.seq_id}: empty step")
    if _bad_drafts(s):
        raise ValueError(f"seq {s.seq_id}: {s.num_drafts} draft tokens in a step of {len(s.token_ids)} tokens "
                         f"(sample {s.sample}): a verify step samples its last token and every draft after it")
    need = -(-s.context_len // BLOCK_SIZE)
    raise ValueError(f"seq {s.seq_id}: block table has {len(s.block_table)} blocks, needs {need}")


@dataclass(slots=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None                          # of the sampled token (when asked)
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    accepted: list[SampledToken] = field(default_factory=list)  # a verify step: the accepted drafts before it

    def emitted(self) -> list[SampledToken]:
        """The tokens this sampling adds to its sequence, in order: the accepted drafts, then itself."""
        return [*self.accepted, self] if self.accepted else [self]


@dataclass
class PromptLogprobResult:
    seq_id: int
    start_pos: int                                        # logprobs[i] is of token at start_pos + 1 + i
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    ranks: list[int] = field(default_factory=list)        # each token's rank in its distribution (1: the likeliest)


@dataclass
class StepOutput:
    sampled: list[SampledToken]                           # one per SeqStep with sample=True, in order
    prompt_logprobs: list[PromptLogprobResult] = field(default_factory=list)
