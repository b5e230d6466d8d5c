"""The executor interface: the CPU (numpy) and GPU (CuPy) executors both implement it,
with the same paged KV layout, so everything above runs identically on either."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.batch import ModelBatch, StepOutput


class Executor(Protocol):
    num_kv_blocks: int          # size of the paged KV pool, in 16-token blocks
    vocab_size: int

    def execute(self, batch: ModelBatch) -> StepOutput:
        """Run one step: write the new tokens' KV, sample where asked."""
        ...

    def forward_logits(self, batch: ModelBatch) -> np.ndarray:
        """float32 logits [T, vocab] for every token of the batch (tests, prompt logprobs)."""
        ...

    def close(self) -> None:
        ...
