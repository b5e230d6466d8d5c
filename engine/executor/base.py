"""The executor interface: the CPU (numpy) and GPU (CuPy) executors both implement it,
with the same paged KV layout, so everything above runs identically on either."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.batch import ModelBatch, StepOutput


class PendingStep(Protocol):
    """A launched step; result() waits for it (the step's one sync) and returns its output."""

    def result(self) -> StepOutput:
        ...


@dataclass
class DoneStep:
    """A step that already ran (synchronous executors, eager GPU steps)."""
    output: StepOutput

    def result(self) -> StepOutput:
        return self.output


def submit(executor, batch: ModelBatch) -> PendingStep:
    """executor.submit(batch) where the executor launches asynchronously, else execute() now."""
    launch = getattr(executor, "submit", None)
    return launch(batch) if launch is not None else DoneStep(executor.execute(batch))


class Executor(Protocol):
    num_kv_blocks: int          # size of the paged KV pool, in 16-token blocks
    vocab_size: int

    def execute(self, batch: ModelBatch) -> StepOutput:
        """Run one step: write the new tokens' KV, sample where asked."""
        ...

    # Optional: submit(batch) -> PendingStep launches the step and returns before it finishes, so
    # the caller's host work overlaps the device (see submit() above and the GPU executor).

    def forward_logits(self, batch: ModelBatch) -> np.ndarray:
        """float32 logits [T, vocab] for every token of the batch (tests, prompt logprobs)."""
        ...

    def close(self) -> None:
        ...
