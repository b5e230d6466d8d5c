"""GpuVerify: the device side of a verify step (speculative decoding), after the step's rows are sampled.

A verify step is an eager step (its sequences feed 1 + k query tokens each: their last token and k drafts,
attended over the paged cache by paged_chunk.cu's tensor-core tiles where the chunk path serves the line,
else paged_decode.cu per row; piecewise graphs replay everything between the attention launches on the dense
lines), its 1 + k rows per sequence sampled by GpuSampler as rows of their own (verify_rows.py). Here: each
row's compare and each sequence's first row go up in one copy, spec_accept.cu counts the accepted drafts and
gathers them with the rows' ids into one buffer, and the read-back takes that buffer (and the logprobs asked
for) in its one copy; result() assembles the engine's SampledTokens (the accepted drafts before the token
after them). Rows with logit processing sample on the host side's eager path and accept there (the same
rule, verify_rows.accepted_counts).

The rejected drafts' KV slots are written and never read: the scheduler counts only accepted positions as
computed and frees blocks only rejected drafts used; the next step overwrites them (engine/batch.py).
"""
from __future__ import annotations

import numpy as np

from engine.batch import StepOutput
from engine.executor.gpu_readback import Readback, ReadbackStep
from engine.executor.verify_rows import VerifyRows
from memory.device_arena import Buffer, buffers_nbytes
from memory.streams import PinnedTwins
from openinfer_kernels.raw_cuda import kernel


class VerifiedStep:
    """A launched verify step: its read-back, then the accepted counts turned into SampledTokens."""

    def __init__(self, readback: ReadbackStep, rows: VerifyRows):
        self.readback, self.rows = readback, rows

    def result(self) -> StepOutput:
        out = self.readback.result()
        return StepOutput(sampled=self.rows.assemble(out.sampled, self.readback.lead_host))


class GpuVerify:
    def __init__(self, arena, max_rows: int, max_seqs: int, sampler, stream):
        import cupy

        self.cp, self.sampler, self.stream = cupy, sampler, stream
        self.max_rows, self.max_seqs = max_rows, max_seqs
        b = arena.take_all("verify", self.buffers(max_rows, max_seqs))
        self.inputs, self.out = b["verify_inputs"], b["verify_out"]      # [compare | row_start], [counts | ids]
        self.tiles = b["verify_tiles"]          # a verify graph's paged_chunk.cu tiles (gpu_verify_graphs.py)
        self.hosts = PinnedTwins(self.inputs.shape, np.int32)
        self.k_accept = kernel("spec_accept", "spec_accept")

    @staticmethod
    def buffers(max_rows: int, max_seqs: int) -> list[Buffer]:
        return [Buffer("verify_inputs", (max_rows + max_seqs + 1,), np.int32),
                Buffer("verify_out", (max_seqs + max_rows,), np.int32),
                Buffer("verify_tiles", (2 * max_rows,), np.int32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.buffers(plan.sample_rows, plan.max_seqs))

    def check(self, seqs: int, rows: int) -> None:
        """ValueError where a verify step's sampled sequences or rows exceed this part's buffers."""
        if rows > self.max_rows or seqs > self.max_seqs:
            raise ValueError(f"a verify step of {seqs} sequences and {rows} sampled rows exceeds "
                             f"the executor's {self.max_seqs} and {self.max_rows} (num_speculative_tokens sizes them)")

    def accept(self, rows: VerifyRows) -> None:
        """Queue the rows' compare and row starts, then spec_accept over the sampler's ids (after its kernels)."""
        S, B, at = rows.num_rows, len(rows.seqs), self.max_rows
        h = self.hosts.take()
        h[:S] = rows.compare
        h[at:at + B + 1] = rows.row_start
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(self.inputs.data.ptr, h.ctypes.data, (at + B + 1) * 4, rt.memcpyHostToDevice, self.stream.ptr)
        self.hosts.sent(self.stream)
        self.k_accept((-(-B // 128),), (128,), (self.sampler.ids, self.inputs, self.inputs[at:], np.int32(B),
                                                self.out), stream=self.stream)

    def queue(self, rows: VerifyRows, greedy: bool, readback: Readback) -> VerifiedStep:
        """After the sampler's kernels over the rows: acceptance, the read-back's tap, then the read-back of the
        accepted counts and ids (and logprobs unless greedy) in one copy."""
        self.accept(rows)
        if readback.tap is not None:        # the accepted ids as spec_accept.cu laid them out
            B = len(rows.seqs)
            readback.tap(rows.seqs, self.out[B:], self.inputs[self.max_rows:], self.out)
        pending = readback.queue(self.sampler, rows.steps, greedy, ids=(self.out, len(rows.seqs)))
        return VerifiedStep(pending, rows)


def verifies(part: GpuVerify | None, sampled: list) -> bool:
    """Whether a step's sampled sequences verify draft tokens; ValueError, before the step runs, where its rows
    exceed what the executor's verify part (None: built without num_speculative_tokens) holds."""
    if not any(s.num_drafts for s in sampled):
        return False
    if part is None:
        raise ValueError("a step with draft tokens on a GPU executor built without num_speculative_tokens")
    part.check(len(sampled), sum(1 + s.num_drafts for s in sampled))
    return True
