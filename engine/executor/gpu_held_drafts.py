"""Speculative decoding over Gated DeltaNet state on the GPU: which held drafts each step's kernels apply.

A verify step's draft rows advance no state slot (causal_conv1d.cu, gated_delta_rule.cu): their outputs are
computed from the state the sequence's own rows leave, and their rows are held in the layer's held buffers (the
model's state arrays "held_conv" / "held_delta", models/qwen3_5.py). The sequence's next step starts right after
the drafts it accepted; its kernels first apply those held rows to the state (the same one-token recurrence and
conv window shift as decoding them), then run its own rows. The numpy executor does the same with its HeldDrafts
(cpu_deltanet_ops.py), the reference.

HeldDraftSlots keeps, per state slot, what the last step its sequence ran held, and turns each step's sequences into
the codes the kernels read (a static input, StepInputs' `held` region, so decode graphs replay them too):
bits 0-7 the sequence's draft rows (its last rows), 8-15 the held drafts it accepted, bit 16 the buffer of
held_delta they sit in (its drafts go to the other: a CTA may still read the previous step's rows while another
writes this step's). A step from position 0 applies none (a new sequence in the slot, or a preempted one
recomputing)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_DRAFTS = 255            # the code's 8 bits of draft rows


@dataclass(frozen=True)
class _Held:
    seq_id: int
    start_pos: int          # the step's first position (an upload of the same step again gives the same code)
    code: int               # what that step's kernels read
    first_draft: int        # the position of its first draft row
    drafts: int
    buffer: int             # the held_delta buffer its drafts went to


def held_code(drafts: int, accepted: int, buffer: int) -> int:
    """The kernels' code of one sequence (gated_delta_rule.cu seq_span)."""
    return drafts | accepted << 8 | buffer << 16


class HeldDraftSlots:
    """max_drafts: the held buffers' rows (the executor's num_speculative_tokens); a step of more is refused."""

    def __init__(self, max_drafts: int):
        if not 0 < max_drafts <= MAX_DRAFTS:
            raise ValueError(f"held drafts: 1..{MAX_DRAFTS} a sequence, got {max_drafts}")
        self.max_drafts = max_drafts
        self._slots: dict[int, _Held] = {}

    def codes(self, batch) -> np.ndarray:
        """int32 [B]: each sequence's code for the step `batch` (a ModelBatch); 0 where its slot is -1."""
        rows = np.diff(batch.cu_seqlens)
        out = np.zeros(len(batch.seqs), np.int32)
        for i, seq in enumerate(batch.seqs):
            slot = int(batch.state_slots[i]) if i < batch.state_slots.shape[0] else -1
            if slot >= 0:
                out[i] = self._code(slot, seq, int(rows[i]))
        return out

    def _code(self, slot: int, seq, rows: int) -> int:
        if not 0 <= seq.num_drafts <= self.max_drafts:
            raise ValueError(f"this executor holds at most {self.max_drafts} drafts a sequence (its "
                             f"num_speculative_tokens), got {seq.num_drafts}")
        last = self._slots.get(slot)
        if last is not None and last.seq_id == seq.seq_id and last.start_pos == seq.start_pos:
            return last.code
        accepted, buffer = 0, 0
        if seq.start_pos > 0 and last is not None and last.seq_id == seq.seq_id and last.drafts:
            accepted, buffer = seq.start_pos - last.first_draft, last.buffer
            if not 0 <= accepted <= last.drafts:
                raise RuntimeError(f"seq {seq.seq_id} steps from position {seq.start_pos}, outside the drafts its "
                                   f"state slot holds ({last.drafts} from position {last.first_draft})")
        code = held_code(seq.num_drafts, accepted, buffer)
        own = rows - seq.num_drafts
        self._slots[slot] = _Held(seq.seq_id, seq.start_pos, code, seq.start_pos + own, seq.num_drafts, 1 - buffer)
        return code
