"""Host reference sampler. PLACEHOLDER (greedy only) until the engine-core work lands:
it defines the semantics every sampler (the GPU one too) must reproduce."""
from __future__ import annotations

import numpy as np

from engine.batch import SampledToken, SeqStep


def sample_step(logits: np.ndarray, seqs: list[SeqStep]) -> list[SampledToken]:
    """logits: float32 [S, V], one row per SeqStep with sample=True (in order)."""
    return [SampledToken(s.seq_id, int(np.argmax(row))) for row, s in zip(logits, seqs)]
