"""StepInputs: a step's ModelBatch arrays in one static device buffer, uploaded in one copy.

Layout (int32, Tm = max tokens per step, Bm = max sequences, W = block-table width): input ids,
positions, KV slots, token -> sequence row, sampled rows (Tm each), the rows' state slots (Bm; -1
where a line keeps no state, and for padding), token offsets (Bm + 1) and held-draft codes (Bm: zero unless
`held_codes` is set, gpu_held_drafts.py), then the block tables [Bm, W].
Decode graphs read the same addresses at every replay; eager steps read prefixes of each region.
`extra_rows` holds row lists of the eager paths (prompt-logprob rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.batch import ModelBatch
from memory.device_arena import Buffer, buffers_nbytes
from memory.kv_pool import check_block_copies
from memory.streams import PinnedTwins


@dataclass
class GpuStepContext:
    """Device views of one step's ModelBatch arrays (static buffers, filled by the executor)."""
    num_tokens: int
    input_ids: object       # int32 [T]
    positions: object       # int32 [T]  (-1: padding)
    slot_mapping: object    # int32 [T]  (-1: padding)
    token_seq: object       # int32 [T]  row of block_tables each token reads
    block_tables: object    # int32 [B, max_blocks]
    sample_rows: object     # int32 [S]
    num_splits: int
    prefill: object = None  # gpu_prefill.PrefillStep: the CuTe kernel's sequences (eager steps only)
    batch: object = None    # the host ModelBatch (eager steps only; None in decode graphs)
    mla: object = None      # gpu_mla_ops: the step's expansion plan, built at its first MLA layer
    dsv4: object = None     # gpu_dsv4_ops.step_rows: the step's per-token rows, gathered at its first layer
    state_slots: object = None  # int32 [B]  state slot of each row (-1: padding; lines with state)
    cu_seqlens: object = None   # int32 [B+1] token offsets of the rows
    held: object = None         # int32 [B]  held-draft codes of the rows (gpu_held_drafts.py; zero without)

    @property
    def decode_only(self) -> bool:
        """One query token per sequence (T == block-table rows; a decode graph's padded rows count as
        sequences of their own): no token of the step attends to another token's new key."""
        return self.num_tokens == self.block_tables.shape[0]


class StepInputs:
    def __init__(self, arena, stream, max_tokens: int, max_seqs: int, max_blocks: int, vocab_size: int,
                 max_model_len: int):
        self.stream, self.vocab_size, self.max_model_len = stream, vocab_size, max_model_len
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        b = arena.take_all("inputs", self.buffers(max_tokens, max_seqs, max_blocks))
        self.device, self.extra_rows = b["step"], b["extra_rows"]
        # pinned staging used in turn: a step may be packed while the ones before wait for their uploads
        self.hosts = PinnedTwins(self.device.shape, np.int32)
        self.mapped = None      # a MappedCopy: uploads by a kernel while set (a restore holds the copy engine)
        self.held_codes = None  # batch -> int32 [B] held-draft codes (HeldDraftSlots.codes), where a line holds drafts

    @staticmethod
    def buffers(max_tokens: int, max_seqs: int, max_blocks: int) -> list[Buffer]:
        return [Buffer("step", (5 * max_tokens + 3 * max_seqs + 1 + max_seqs * max_blocks,), np.int32),
                Buffer("extra_rows", (max_tokens,), np.int32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.buffers(plan.max_tokens, plan.max_seqs, plan.max_blocks))

    def check(self, batch: ModelBatch, num_kv_blocks: int, skip_ids: int = 0) -> None:
        """A step this executor cannot take raises ValueError (the scheduler, built from the same
        options, never plans one; a direct caller learns what is wrong). skip_ids: leading rows whose ids
        are not checked (a fed step's placeholders, taken on the device)."""
        T, B = batch.num_tokens, len(batch.seqs)
        if T == 0 or T > self.max_tokens:
            raise ValueError(f"step has {T} tokens; the GPU executor takes 1..{self.max_tokens}")
        if B > self.max_seqs:
            raise ValueError(f"step has {B} sequences, more than max_num_seqs={self.max_seqs}")
        if int(batch.positions.max()) >= self.max_model_len:
            raise ValueError(f"position {int(batch.positions.max())} is beyond max_model_len {self.max_model_len}")
        if int(batch.block_tables.max()) >= num_kv_blocks:
            raise ValueError(f"block id {int(batch.block_tables.max())} is outside the KV pool "
                             f"({num_kv_blocks} blocks)")
        ids = batch.input_ids[skip_ids:]
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        check_block_copies(batch.block_copies, num_kv_blocks)

    def _regions(self) -> tuple[int, int, int, int]:
        """Offsets of the state slots, the token offsets, the held-draft codes and the block tables."""
        Tm, Bm = self.max_tokens, self.max_seqs
        return 5 * Tm, 5 * Tm + Bm, 5 * Tm + 2 * Bm + 1, 5 * Tm + 3 * Bm + 1

    @property
    def host(self) -> np.ndarray:
        """The staging buffer of the last upload."""
        return self.hosts.current

    def _next_host(self) -> np.ndarray:
        return self.hosts.take()

    def upload(self, batch: ModelBatch, num_splits, pad_to: int | None = None, fed_ids=None,
               pad_tokens: int | None = None) -> GpuStepContext:
        """Copy the step's arrays into the device buffer (one async copy on the stream) and return
        their views. pad_to (decode graphs): pad a one-token-per-sequence batch to that many rows;
        padded rows have position and slot -1 (attention skips them, no KV is written) and read
        block-table row 0. num_splits(T, max_context): the attention split count of the step.
        fed_ids: (device array, R): its first R ids replace the batch's first R (a step queued before
        the step that samples those rows' input ids finished: async scheduling; batch.fed_rows). pad_tokens (piecewise graphs of eager
        steps): pad the step's tokens, not its sequences, to that many rows (position and slot -1)."""
        import cupy

        T, B = batch.num_tokens, len(batch.seqs)
        Tm, mb, h = self.max_tokens, self.max_blocks, self._next_host()
        lens = np.diff(batch.cu_seqlens)
        h[0:T] = batch.input_ids
        h[Tm:Tm + T] = batch.positions
        h[2 * Tm:2 * Tm + T] = batch.slot_mapping
        h[3 * Tm:3 * Tm + T] = np.repeat(np.arange(B, dtype=np.int32), lens)
        S = batch.sample_rows.shape[0]
        h[4 * Tm:4 * Tm + S] = batch.sample_rows
        slots, cu, held, first_table = self._regions()
        h[slots:slots + B] = batch.state_slots if batch.state_slots.shape[0] == B else -1
        h[cu:cu + B + 1] = batch.cu_seqlens
        h[held:held + B] = self.held_codes(batch) if self.held_codes is not None else 0
        rows = B
        pad = pad_to if pad_to is not None else pad_tokens
        if pad is not None:                       # padded token rows: id 0, position and slot -1, sequence 0
            h[T:pad], h[Tm + T:Tm + pad], h[2 * Tm + T:2 * Tm + pad], h[3 * Tm + T:3 * Tm + pad] = 0, -1, -1, 0
        if pad_to is not None:                    # and as many padded sequences (decode graphs)
            h[4 * Tm:4 * Tm + pad_to] = np.arange(pad_to, dtype=np.int32)
            h[slots + B:slots + pad_to] = -1
            h[held + B:held + pad_to] = 0
            h[cu + B + 1:cu + pad_to + 1] = np.arange(T + 1, T + pad_to - B + 1, dtype=np.int32)
            T = S = rows = pad_to
        tables = h[first_table:first_table + rows * mb].reshape(rows, mb)
        tables[:B, :batch.block_tables.shape[1]] = batch.block_tables
        tables[:B, batch.block_tables.shape[1]:] = 0
        tables[B:] = 0
        n = first_table + rows * mb
        if self.mapped is not None:
            self.mapped([(h, self.device, n)], to_host=False)
        else:
            cupy.cuda.runtime.memcpyAsync(self.device.data.ptr, h.ctypes.data, n * 4,
                                          cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        self.hosts.sent(self.stream)
        if fed_ids is not None:
            ids, fed = fed_ids
            cupy.cuda.runtime.memcpyAsync(self.device.data.ptr, ids.data.ptr, fed * 4,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
        max_context = int(batch.context_lens.max()) if pad_to is None else self.max_model_len
        T = pad if pad is not None else T
        return self.views(T, rows, S, num_splits(T, max_context))

    def upload_padding(self, rows: int, splits: int, seqs: int | None = None, sampled: int | None = None
                       ) -> GpuStepContext:
        """A context of `rows` padded token rows only (graph warm-up: every row has position and slot -1,
        so the step writes no KV and attends to nothing), in `seqs` sequences (default one per row, a
        decode graph's; piecewise graphs of eager steps warm up on one), the last one taking the rest;
        `sampled` rows sampled (default one a sequence; a verify graph's: every row)."""
        import cupy

        seqs = rows if seqs is None else seqs
        sampled = seqs if sampled is None else sampled
        Tm, h = self.max_tokens, self._next_host()
        slots, cu, held, first_table = self._regions()
        h[0:rows], h[Tm:Tm + rows], h[2 * Tm:2 * Tm + rows], h[3 * Tm:3 * Tm + rows] = 0, -1, -1, 0
        h[held:held + seqs] = 0
        h[4 * Tm:4 * Tm + sampled] = np.arange(sampled, dtype=np.int32)
        h[slots:slots + seqs] = -1
        h[cu:cu + seqs] = np.arange(seqs, dtype=np.int32)
        h[cu + seqs] = rows
        h[first_table:first_table + seqs * self.max_blocks] = 0
        n = first_table + seqs * self.max_blocks
        cupy.cuda.runtime.memcpyAsync(self.device.data.ptr, h.ctypes.data, n * 4,
                                      cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        self.hosts.sent(self.stream)
        return self.views(rows, seqs, sampled, splits)

    def views(self, T: int, B: int, S: int, splits: int) -> GpuStepContext:
        Tm, mb, d = self.max_tokens, self.max_blocks, self.device
        slots, cu, held, first_table = self._regions()
        return GpuStepContext(num_tokens=T, input_ids=d[0:T], positions=d[Tm:Tm + T],
                              slot_mapping=d[2 * Tm:2 * Tm + T], token_seq=d[3 * Tm:3 * Tm + T],
                              block_tables=d[first_table:first_table + B * mb].reshape(B, mb),
                              sample_rows=d[4 * Tm:4 * Tm + S], num_splits=splits,
                              state_slots=d[slots:slots + B], cu_seqlens=d[cu:cu + B + 1], held=d[held:held + B])

    def upload_rows(self, rows: np.ndarray):
        """A row list for an eager gather (prompt-logprob rows): its device view."""
        self.extra_rows[: rows.size].set(rows.astype(np.int32), stream=self.stream)
        return self.extra_rows[: rows.size]
