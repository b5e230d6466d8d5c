"""Prompt-lookup drafts on the GPU executor (engine/ngram.py's semantics, ngram_draft.cu computes them).

Each running sequence's ids so far live in a row of one device buffer, [max_num_seqs, max_model_len] int32
(4 bytes an id, outside the arena as an EAGLE-3 head's weights are): uploaded once, the first time the sequence
is proposed for (after its prefill, or its resume after a preemption); from then on each step appends on the
device the ids it emitted (ngram_append: the sampler's id, or spec_accept.cu's accepted drafts and the token
after them), and ngram_draft computes, in the same queue, each stepped sequence's next draft (k ids, the
config's most). The step's read-back event covers their copy to the host. What crosses, and when:

* a step's launch (the read-back's `tap`): up, its sampled sequences' rows and append positions (two words
  each, through the mapping); down, with the step's results, each one's new length, draft count and k drafts.
* propose: for a sequence whose drafts came with the last step and whose length there is the host's, nothing
  (its drafts cut to its limit). Any other (its first proposal, a step sampled on the host side, ids the host
  cut) has its missing ids uploaded, and one launch and one read-back serve them together: the one round trip,
  in the steps that admit or resume sequences, not in a steady decode.
* steps launched ahead without a proposal (the engine loop's overlap while no sequence has a draft): each one's
  tap appends right after the step before's one id, so the row stays the sequence's ids (synced follows it);
  none_drafted reads the last landed read-back's draft counts, no wait, to say whether the next step may go
  without drafts.

The engine's drafts stay host lists (the scheduler lays them out as query tokens, a grammar keeps its valid
prefix, the counters count them); a sequence with no free row is drafted on the host (ngram_draft).
"""
from __future__ import annotations

import numpy as np

from engine.ngram import ngram_draft
from engine.speculative import SpeculativeConfig
from memory.streams import PinnedTwins, pinned_array
from openinfer_kernels.raw_cuda import kernel

DRAFT_THREADS = 256             # ngram_draft.cu NGRAM_THREADS
APPEND_THREADS = 128


class CupyDevice:
    """What the proposer asks of the device: int32 arrays, pinned host arrays, uploads, launches of
    ngram_draft.cu's entries, mapped copies, all on the executor's compute stream."""

    def __init__(self, executor):
        import cupy

        self.cp, self.stream, self.copy = cupy, executor.stream, executor.mapped_copy
        self.kernels = {entry: kernel("ngram_draft", entry) for entry in ("ngram_draft", "ngram_append")}

    def zeros(self, shape):
        return self.cp.zeros(shape, np.int32)

    def pinned(self, words: int) -> np.ndarray:
        return pinned_array((words,), np.int32)

    def staging(self, words: int) -> PinnedTwins:
        return PinnedTwins((words,), np.int32)

    def write(self, dst, values: np.ndarray) -> None:
        dst.set(values, stream=self.stream)

    def launch(self, entry: str, grid: int, block: int, args: tuple) -> None:
        self.kernels[entry]((grid,), (block,), args, stream=self.stream)

    def wait(self) -> None:
        self.stream.synchronize()


class GpuNgramProposer:
    """DraftProposer with the sequences' ids on the device; also the Speculator's draft_states (keep())."""

    def __init__(self, device, config: SpeculativeConfig, max_seqs: int, max_model_len: int):
        self.device, self.stream, self.copy = device, device.stream, device.copy
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.k = k = config.num_speculative_tokens
        seqs, self.stride = max_seqs, max_model_len
        self.tokens = device.zeros((seqs, self.stride))
        self.args = device.zeros(3 * seqs)                  # rows | append positions or lengths | limits
        self.result = device.zeros(seqs * (k + 2))          # lengths | counts | drafts [B, k]
        self.none_accepted = device.zeros(seqs)
        self.row_start = device.zeros(seqs + 1)
        device.write(self.row_start, np.arange(seqs + 1, dtype=np.int32))
        self.hosts = device.staging(3 * seqs)
        self.step_hosts = [device.pinned(seqs * (k + 2)) for _ in range(2)]
        self.demand_host = device.pinned(seqs * (k + 2))
        self.free = list(range(seqs - 1, -1, -1))
        self.rows: dict[int, int] = {}        # seq_id -> its row
        self.synced: dict[int, int] = {}      # seq_id -> leading ids of its row equal to the sequence's
        # the last step's: seq_id -> (its index, append position, drafts it verified)
        self.stepped: dict[int, tuple[int, int, int]] = {}
        self.turn, self.stepped_count = 0, 0
        self.stepped_host = self.step_hosts[0]
        self.landed: tuple[np.ndarray, int, dict] = (self.step_hosts[1], 0, {})    # the step before's, read back

    def keep(self, seq_ids: set[int]) -> None:
        """Free the rows of sequences not in seq_ids (finished, aborted, preempted)."""
        for seq_id in [s for s in self.rows if s not in seq_ids]:
            self.free.append(self.rows.pop(seq_id))
            self.synced.pop(seq_id, None)
            self.stepped.pop(seq_id, None)

    def tap(self, seqs: list, ids, row_start=None, accepted=None) -> None:
        """A step's launch, after its sampled ids (`ids`, rows from row_start[b], accepted[b] drafts each; None:
        one row a sequence, none accepted): append each sequence's emitted ids to its row, draft from there and
        queue the drafts' copy to the host (before the step's read-back records its event). No seqs: a step
        sampled on the host side (GpuExecutor.submit), after which no earlier tap's drafts hold."""
        B, k = len(seqs), self.k
        rows = [self.rows.get(s.seq_id, -1) for s in seqs]
        last = self.stepped
        self.landed = (self.stepped_host, self.stepped_count, last)
        self.stepped, self.stepped_count = {}, B
        if max(rows, default=-1) < 0:
            return
        at = [s.start_pos + len(s.token_ids) - s.num_drafts for s in seqs]
        for s, r, a in zip(seqs, rows, at):
            before = last.get(s.seq_id)     # a step launched ahead, right after one id appended at the synced end
            if r >= 0 and before is not None and not before[2] and a == before[1] + 1 == self.synced[s.seq_id] + 1:
                self.synced[s.seq_id] = a
        self._upload(rows, at, [k if r >= 0 else 0 for r in rows])
        lengths, counts, drafts = self.result[:B], self.result[B:2 * B], self.result[2 * B:]
        self.device.launch("ngram_append", -(-B // APPEND_THREADS), APPEND_THREADS,
                           (self.tokens, np.int64(self.stride), self.args, self.args[B:], ids,
                            self.row_start if row_start is None else row_start,
                            self.none_accepted if accepted is None else accepted, np.int32(B), lengths))
        self._draft(B, lengths, counts, drafts)
        self.turn ^= 1                  # the host may still read the last step's drafts while this one's copy runs
        self.stepped_host = self.step_hosts[self.turn]
        self.copy([(self.stepped_host, self.result, B * (k + 2))], to_host=True)
        self.stepped = {s.seq_id: (b, at[b], s.num_drafts) for b, (s, r) in enumerate(zip(seqs, rows))
                        if r >= 0 and self.synced[s.seq_id] == at[b]}

    def propose(self, seqs: list, limits: list[int]) -> list[list[int]]:
        out: list[list[int] | None] = [self._from_step(s, limit) for s, limit in zip(seqs, limits)]
        demand = []
        for i, seq in enumerate(seqs):
            if out[i] is not None:
                continue
            if self._sync(seq):
                demand.append(i)
            else:                       # no free row: the host's lookup
                out[i] = ngram_draft(np.asarray(seq.token_ids, np.int64), self.min_n, self.max_n, limits[i])
        if demand:
            for i, drafts in zip(demand, self._on_demand([seqs[i] for i in demand], [limits[i] for i in demand])):
                out[i] = drafts
        return out

    def none_drafted(self, seqs: list) -> bool:
        """Whether no sequence of seqs had a draft at its ids known now, by the last landed read-back (no wait);
        False where it does not say (a sequence not in that step, its row not the host's ids)."""
        h, B, entries = self.landed
        for seq in seqs:
            entry = entries.get(seq.seq_id)
            if entry is None or int(h[entry[0]]) != len(seq.token_ids) or int(h[B + entry[0]]):
                return False
        return True

    def _from_step(self, seq, limit: int) -> list[int] | None:
        """seq's drafts from the last step's read-back, where its row there holds exactly its ids (the step
        appended right after its synced ids, up to the host's length); else None, its row to resync."""
        entry = self.stepped.get(seq.seq_id)
        if entry is None:
            return None
        b, at, _ = entry
        B, length, h, synced = self.stepped_count, len(seq.token_ids), self.stepped_host, self.synced[seq.seq_id]
        if synced != at or int(h[b]) != length:
            self.synced[seq.seq_id] = min(synced, length)
            return None
        self.synced[seq.seq_id] = length
        count = min(int(h[B + b]), limit)
        return h[2 * B + b * self.k:2 * B + b * self.k + count].tolist()

    def _sync(self, seq) -> bool:
        """seq's row holding all its ids (a row taken, the missing ids uploaded); False: no row free."""
        row = self.rows.get(seq.seq_id)
        if row is None:
            if not self.free:
                return False
            row = self.rows[seq.seq_id] = self.free.pop()
            self.synced[seq.seq_id] = 0
        have, length = self.synced[seq.seq_id], len(seq.token_ids)
        if have < length:
            self.device.write(self.tokens[row, have:length], np.asarray(seq.token_ids[have:length], np.int32))
        self.synced[seq.seq_id] = length
        return True

    def _on_demand(self, seqs: list, limits: list[int]) -> list[list[int]]:
        """Drafts for synced rows now: one launch, one read-back, waited for."""
        B, k = len(seqs), self.k
        self._upload([self.rows[s.seq_id] for s in seqs], [len(s.token_ids) for s in seqs],
                     [min(limit, k) for limit in limits])
        counts, drafts = self.result[B:2 * B], self.result[2 * B:]
        self._draft(B, self.args[B:], counts, drafts)
        self.copy([(self.demand_host, self.result, B * (k + 2))], to_host=True)
        self.device.wait()
        h = self.demand_host
        return [h[2 * B + b * k:2 * B + b * k + int(h[B + b])].tolist() for b in range(B)]

    def _upload(self, rows: list[int], second: list[int], limits: list[int]) -> None:
        B = len(rows)
        h = self.hosts.take()
        h[:B], h[B:2 * B], h[2 * B:3 * B] = rows, second, limits
        self.copy([(h, self.args, 3 * B)], to_host=False)
        self.hosts.sent(self.stream)

    def _draft(self, B: int, lengths, counts, drafts) -> None:
        self.device.launch("ngram_draft", B, DRAFT_THREADS,
                           (self.tokens, np.int64(self.stride), self.args, lengths, self.args[2 * B:],
                            np.int32(self.min_n), np.int32(self.max_n), np.int32(self.k), drafts, counts))


def attach_gpu_ngram(executor, config: SpeculativeConfig) -> GpuNgramProposer:
    """The device proposer, tapping every step's sampled ids from now on."""
    proposer = GpuNgramProposer(CupyDevice(executor), config, executor.plan.max_seqs, executor.max_model_len)
    executor.readback.tap = proposer.tap
    return proposer
