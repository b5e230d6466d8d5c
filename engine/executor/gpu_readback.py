"""The sampled results of a launched step on their way to the host: the sampler's ids (and the
logprobs asked for) are written into pinned host buffers behind the step's kernels, and an event is
recorded after them. One small kernel writes them through the buffers' mapping into the device's address
space (gpu_mapped_copy.py), not a device-to-host memcpy: a copy engine busy with a host-tier offload would
hold such a memcpy up until the whole offload has gone (bench/copy_contention.py). The step returns at once as a ReadbackStep; its result() waits on that
event, the step's one sync. At most two steps are in flight (async scheduling queues the next decode
step before this one is read), so two sets of buffers serve every step, graphed or eager, in turn."""
from __future__ import annotations

import numpy as np

from engine.batch import SampledToken, StepOutput
from engine.executor.gpu_sampler import MAX_TOP_LOGPROBS
from memory.streams import pinned_array


class ReadbackStep:
    """A launched step whose ids (and logprobs, when asked) are on their way into pinned host memory.
    logprobs[i]: the row's SamplingParams.logprobs (None: not asked). lead_host: the words read back before the
    ids (a verify step's accepted counts, gpu_verify.py)."""

    def __init__(self, seq_ids: list[int], ids_host: np.ndarray, done, logprobs: list | None = None,
                 lp_host: np.ndarray | None = None, top_ids_host: np.ndarray | None = None,
                 top_lp_host: np.ndarray | None = None, lead_host: np.ndarray | None = None):
        self.seq_ids, self.ids_host, self.done, self.lead_host = seq_ids, ids_host, done, lead_host
        self.logprobs, self.lp_host, self.top_ids_host, self.top_lp_host = logprobs, lp_host, top_ids_host, top_lp_host

    def result(self) -> StepOutput:
        self.done.synchronize()
        out = [SampledToken(s, t) for s, t in zip(self.seq_ids, self.ids_host.tolist())]
        if self.logprobs is not None:
            lps = self.lp_host.tolist()
            for i, (tok, n) in enumerate(zip(out, self.logprobs)):
                if n is not None:
                    tok.logprob = lps[i]
                    tok.top_logprobs = list(zip(self.top_ids_host[i, :n].tolist(),
                                                self.top_lp_host[i, :n].tolist())) if n else []
        return StepOutput(sampled=out)


class ReadbackSlot:
    """Pinned host buffers for `rows` sampled rows and the event after their copies."""

    def __init__(self, rows: int):
        import cupy

        self.ids_host = pinned_array((2 * rows,), np.int32)     # a verify step's counts (< rows) lead its ids
        self.lp_host = pinned_array((rows,), np.float32)
        self.top_ids_host = pinned_array((rows, MAX_TOP_LOGPROBS), np.int32)
        self.top_lp_host = pinned_array((rows, MAX_TOP_LOGPROBS), np.float32)
        self.ready = cupy.cuda.Event(block=False, disable_timing=True)


class Readback:
    """Two slots used in turn: with async scheduling a step is queued before the one before it has
    been read, so each step's results land in buffers the other's copies do not touch."""

    def __init__(self, rows: int, stream, copy):
        """copy: the executor's MappedCopy on `stream`. tap(seqs, ids, row_start, accepted), when set, is queued
        before each step's copies, which its own then precede (gpu_ngram.py: the drafts of the next step); a verify
        step's comes from GpuVerify.queue (its rows' starts and accepted counts), a plain one's from here (None)."""
        self.tap = None
        self.stream = stream
        self.slots = [ReadbackSlot(rows), ReadbackSlot(rows)]
        self.turn = 0
        self.copy = copy

    def queue(self, sampler, seqs, greedy: bool, ids=None) -> ReadbackStep:
        """Copy the sampler's results for `seqs` (rows 0..n-1) back; greedy: the ids alone. ids: (device array,
        lead): read the rows' ids from that array after its first `lead` words, which come back too (a verify
        step's accepted counts, gpu_verify.py)."""
        n = len(seqs)
        if ids is None and self.tap is not None:
            self.tap(seqs, sampler.ids)
        self.turn ^= 1
        slot = self.slots[self.turn]
        source, lead = ids if ids is not None else (sampler.ids, 0)
        pairs = [(slot.ids_host, source, lead + n)]
        logprobs = None if greedy else [q.params.logprobs for q in seqs]
        if logprobs is not None and any(k is not None for k in logprobs):
            pairs.append((slot.lp_host, sampler.logprob, n))
            if any(logprobs):
                pairs += [(slot.top_ids_host, sampler.top_ids, n * MAX_TOP_LOGPROBS),
                          (slot.top_lp_host, sampler.top_lp, n * MAX_TOP_LOGPROBS)]
        else:
            logprobs = None
        self.copy(pairs, to_host=True)
        slot.ready.record(self.stream)
        return ReadbackStep([q.seq_id for q in seqs], slot.ids_host[lead:lead + n], slot.ready, logprobs,
                            slot.lp_host[:n], slot.top_ids_host[:n], slot.top_lp_host[:n], slot.ids_host[:lead])
