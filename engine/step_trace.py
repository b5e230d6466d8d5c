"""The step profile: one JSON line per engine step (EngineConfig.step_trace, `--step-trace FILE`),
for finding where a step's time goes under load. `bench/step_profile.py` turns a trace into tables.

Per step: its tokens (prefill: tokens of sequences still in their prompt; decode: one per sequence
past it), sequences, whether it replayed a CUDA graph, whether it was planned while the step before
ran, and its host phases in milliseconds:
  schedule  scheduler.schedule, or confirming the step planned ahead
  copy      the host KV tier's block copies queued
  build     ModelBatch.build
  launch    executor.submit (input upload and kernel launches; an eager step with logit processing
            runs to the end in it)
  emit      the previous step's tokens detokenized and sent (overlaps the device)
  plan      the next decode step planned (overlaps the device)
  wait      blocked on the step's result
  process   the step's results accounted, its tokens turned into events
and gpu_ms, the device time between the step's first and last queued work (CUDA events), and cpu_ms, the
CPU time of the engine thread over the step (the CPU executor computes on it: with one BLAS thread, what
the step takes on a core of its own, however loaded the machine).
"""
from __future__ import annotations

import json
import time

PHASES = ("schedule", "copy", "build", "launch", "emit", "plan", "wait", "process")


class StepTrace:
    def __init__(self, path: str):
        self.file = open(path, "w", encoding="utf-8", buffering=1 << 16)
        self.t0 = time.perf_counter()
        self.row: dict = {}
        self.mark_at = self.cpu_at = 0.0

    def begin(self) -> None:
        self.row = {p: 0.0 for p in PHASES}
        self.cpu_at = time.thread_time()
        self.mark_at = time.perf_counter()
        self.row["t"] = round(self.mark_at - self.t0, 6)
        self.row["tm"] = round(time.monotonic(), 6)         # the request trace's clock (server/request_trace.py)

    def mark(self, phase: str) -> None:
        """Charge the time since the last mark to phase."""
        now = time.perf_counter()
        self.row[phase] += (now - self.mark_at) * 1e3
        self.mark_at = now

    def end(self, out, planned: bool, executor) -> None:
        """Write the step's line: its SchedulerOutput, whether it was planned ahead, the executor that
        ran it (whether it replayed a graph, its GPU time)."""
        gpu_ms = executor.last_gpu_ms()
        prefill = sum(len(s.token_ids) for s in out.steps if s.start_pos < s.prompt_len or len(s.token_ids) > 1)
        row = self.row
        for p in PHASES:
            row[p] = round(row[p], 4)
        row.update(seqs=len(out.steps), prefill=prefill, decode=out.num_tokens - prefill, planned=planned,
                   graphed=executor.last_step_graphed, gpu_ms=None if gpu_ms is None else round(gpu_ms, 4),
                   cpu_ms=round((time.thread_time() - self.cpu_at) * 1e3, 4))
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


class NoTrace:
    """The trace when none is asked for: every call does nothing."""

    def begin(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def end(self, out, planned: bool, executor) -> None:
        pass

    def close(self) -> None:
        pass
