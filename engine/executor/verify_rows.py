"""A verify step's sampled rows as a device sampler takes them (speculative decoding on the GPU).

engine/sampling.py verify_seq defines the verification: a sequence with drafts d_1..d_k has k + 1 sampled rows,
row j sampled as the plain decode row after d_1..d_j would be, and the drafts accepted while d_{j+1} equals row
j's token. A device sampler samples rows independently, so each row becomes a SeqStep of its own (`steps`):
the sequence's history with d_1..d_j, num_generated + j (min_tokens, the seeded draw's step), its grammar's
mask after d_1..d_j (`bitmask`, computed here on the host: llguidance's matchers live there). `compare[r]` is
the draft row r's token must equal for the next row to count, -1 on each sequence's last row and where its
grammar completes at that row's draft (verify_seq stops there: that row's token ends the sequence).
Acceptance (`accepted_counts`, spec_accept.cu on the device) counts, per sequence, the leading rows whose
token equals their compare; `assemble` turns the per-row tokens into the engine's SampledTokens.

A verify graph (gpu_verify_graphs.py) runs a static shape: `bucket` sequences of `per_seq` = 1 + k rows each.
`pad_verify_batch` lays a step out so (a sequence's tokens at rows i · per_seq.., the rest position and slot -1:
no KV written, nothing attended; filler sequences after the step's) and `pad_rows` its sampled rows alike
(filler rows greedy, compare -1, so acceptance never reaches them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from engine.batch import ModelBatch, SampledToken, SeqStep
from engine.request import SamplingParams
from engine.scheduler import counts_history

FILLER = SeqStep(seq_id=-1, token_ids=[0], start_pos=0, block_table=[], sample=True,
                 params=SamplingParams(temperature=0.0))   # a padded sequence's (and row's) step: greedy, no logprobs


@dataclass
class VerifyRows:
    seqs: list[SeqStep]            # the step's sampled sequences, in order
    steps: list[SeqStep]           # one per sampled row, grouped by sequence
    compare: np.ndarray            # int32 [S]: the draft each row's token must equal (-1: stop after this row)
    row_start: np.ndarray          # int32 [B + 1]: each sequence's first row
    bitmask: tuple[list[int], np.ndarray] | None = None   # (grammar rows, their bitmask rows); None: no grammar

    @property
    def num_rows(self) -> int:
        return len(self.steps)

    def accept(self, tokens: list[SampledToken]) -> list[SampledToken]:
        """assemble() of rows sampled on the host side (accepted_counts: spec_accept.cu's rule)."""
        ids = np.fromiter((t.token_id for t in tokens), np.int64, len(tokens))
        return self.assemble(tokens, accepted_counts(ids, self.compare, self.row_start))

    def assemble(self, tokens: list[SampledToken], counts: np.ndarray) -> list[SampledToken]:
        """One SampledToken per sequence from its rows' tokens: the token of row `counts[b]` (the first that
        did not match), its `accepted` the rows before it (each with its own logprobs)."""
        out = []
        for b, s in enumerate(self.seqs):
            first, a = int(self.row_start[b]), int(counts[b])
            token = tokens[first + a]
            token.accepted = tokens[first:first + a]
            out.append(token)
        return out


def verify_rows(seqs: list[SeqStep]) -> VerifyRows:
    """The rows of the sampled sequences `seqs` (a sequence without drafts: one row, as a decode)."""
    steps, compare, starts, masks, mask_rows = [], [], [0], [], []
    for s in seqs:
        drafts = s.token_ids[len(s.token_ids) - s.num_drafts:] if s.num_drafts else []
        row_masks, stop = _grammar_masks(s, drafts)
        for j in range(len(drafts) + 1):
            if j < len(row_masks):
                mask_rows.append(len(steps))
                masks.append(row_masks[j])
            steps.append(_row_step(s, drafts[:j]))
            compare.append(drafts[j] if j < len(drafts) and j != stop else -1)
        starts.append(len(steps))
    bitmask = (mask_rows, np.stack(masks)) if masks else None
    return VerifyRows(seqs=seqs, steps=steps, compare=np.asarray(compare, np.int32),
                      row_start=np.asarray(starts, np.int32), bitmask=bitmask)


def _row_step(s: SeqStep, ahead: list[int]) -> SeqStep:
    """Row j of s's verification: the decode step after the drafts `ahead` (d_1..d_j)."""
    if not ahead and not s.num_drafts:
        return s
    # only penalties read the history: other rows keep the sequence's (no copy of the context per row)
    history = s.history + list(ahead) if counts_history(s.params) else s.history
    return dataclasses.replace(s, token_ids=[], history=history, num_drafts=0,
                               num_generated=s.num_generated + len(ahead))


def _grammar_masks(s: SeqStep, drafts: list[int]) -> tuple[list[np.ndarray], int]:
    """The grammar's bitmask before each row (after d_1..d_j) up to the row whose draft completes it, and that
    row (-1: none); ([], -1) without a grammar. The grammar takes the drafts and gives them back."""
    g = s.grammar
    if g is None:
        return [], -1
    masks, taken, stop = [], 0, -1
    try:
        for j in range(len(drafts) + 1):
            masks.append(g.bitmask())
            if j == len(drafts):
                break
            if not g.advance_draft(drafts[j]):
                raise RuntimeError(f"the grammar refused draft token {drafts[j]}, which the proposer checked")
            taken += 1
            if g.done:                  # complete at d_{j+1}: row j's token ends the sequence
                stop = j
                break
    finally:
        if taken:
            g.rollback(taken)
    return masks, stop


def accepted_counts(ids: np.ndarray, compare: np.ndarray, row_start: np.ndarray) -> np.ndarray:
    """int32 [B]: per sequence, how many leading rows' tokens equal their compare (spec_accept.cu's result; the
    host's where a step was sampled on the host)."""
    counts = np.zeros(len(row_start) - 1, np.int32)
    for b in range(len(counts)):
        r = int(row_start[b])
        while compare[r] >= 0 and ids[r] == compare[r]:
            r += 1
        counts[b] = r - int(row_start[b])
    return counts


def pad_rows(rows: VerifyRows, per_seq: int, bucket: int) -> VerifyRows:
    """rows in a verify graph's layout: sequence i's rows at i · per_seq.., every other row FILLER, compare -1."""
    steps, compare = [FILLER] * (bucket * per_seq), np.full(bucket * per_seq, -1, np.int32)
    where = np.zeros(rows.num_rows, np.int64)           # each row's place in the padded layout
    for i in range(len(rows.seqs)):
        first, end = int(rows.row_start[i]), int(rows.row_start[i + 1])
        if end - first > per_seq:
            raise ValueError(f"a sequence of {end - first} verify rows in a graph of {per_seq} rows a sequence")
        where[first:end] = i * per_seq + np.arange(end - first)
        steps[i * per_seq:i * per_seq + end - first] = rows.steps[first:end]
    compare[where] = rows.compare
    bitmask = None if rows.bitmask is None else (where[rows.bitmask[0]].tolist(), rows.bitmask[1])
    return VerifyRows(seqs=rows.seqs, steps=steps, compare=compare,
                      row_start=(np.arange(len(rows.seqs) + 1) * per_seq).astype(np.int32), bitmask=bitmask)


def pad_verify_batch(batch: ModelBatch, per_seq: int, bucket: int) -> ModelBatch:
    """batch as `bucket` sequences of `per_seq` token rows (a verify graph's shape): sequence i's tokens at rows
    i · per_seq.. with their ids, positions and slots, the other rows id 0 and position and slot -1; filler
    sequences (block-table rows of zeros, state slot -1) after the batch's; every row sampled."""
    B, T = len(batch.seqs), bucket * per_seq
    lens = np.diff(batch.cu_seqlens)
    if B > bucket or int(lens.max(initial=0)) > per_seq or batch.block_copies.size or batch.lora_slots is not None:
        raise ValueError("pad_verify_batch: the step does not fit the verify graph's shape")
    dst = np.repeat(np.arange(B) * per_seq - batch.cu_seqlens[:-1], lens) + np.arange(batch.num_tokens)
    ids, positions, slots = np.zeros(T, np.int32), np.full(T, -1, np.int32), np.full(T, -1, np.int32)
    ids[dst], positions[dst], slots[dst] = batch.input_ids, batch.positions, batch.slot_mapping
    tables = np.zeros((bucket, batch.block_tables.shape[1]), np.int32)
    tables[:B] = batch.block_tables
    context = np.zeros(bucket, np.int32)
    context[:B] = batch.context_lens
    return ModelBatch(seqs=batch.seqs + [FILLER] * (bucket - B), input_ids=ids, positions=positions,
                      slot_mapping=slots, cu_seqlens=(np.arange(bucket + 1) * per_seq).astype(np.int32),
                      context_lens=context, block_tables=tables, sample_rows=np.arange(T, dtype=np.int32),
                      state_slots=np.full(bucket, -1, np.int32))
