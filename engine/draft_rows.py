"""The target's hidden states a draft reads (EAGLE-3 heads, MTP layers), kept by sequence and position.

The executor's forward hands a keeper (Ops.keep_hidden) the residual stream entering the layers a draft asked
for (EAGLE-3), and the executor hands it the forward's output as layer FINAL (MTP); after the step, the draft
files the step's rows of each sequence by position (`keep_step_rows`) until its catch-up reads them
(`KeptRows.take_rows`). Rows at positions the target later recomputes (a rejected draft's)
are overwritten before they are read. A sequence's rows start at the first position the target computed for it
(a prefix hit's cached positions have none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from engine.batch import ModelBatch


FINAL = -1      # the keeper's key of the forward's output, the final-normed hidden states (what an MTP layer reads)


class HiddenKeeper:
    """Ops.keep_hidden's keeper on the host: a copy of the step's hidden states entering each of `layers`."""

    def __init__(self, layers):
        self.layers, self.kept = frozenset(layers), {}

    def keep(self, layer: int, x) -> None:
        if layer in self.layers:
            self.kept[layer] = np.array(x, np.float32)


@dataclass
class KeptRows:
    first: int                   # the first position with the target's hidden states
    end: int                     # the draft has read the rows below `end`
    aux: np.ndarray              # float32 [n, width]: the target's kept hidden states at end + i (not yet read)
    last: np.ndarray | None = None   # the draft's output at end - 1 (the next draft's hidden input)
    xp: object = np                  # the arrays' module

    def keep_rows(self, pos: np.ndarray, rows: np.ndarray) -> None:
        """The target's hidden states `rows` at positions `pos` (those below `end` are read already)."""
        ok = np.flatnonzero(pos >= self.end)
        at = pos[ok] - self.end
        if at.size and at.max() >= len(self.aux):
            more = self.xp.zeros((int(at.max()) + 1 - len(self.aux), self.aux.shape[1]), np.float32)
            self.aux = self.xp.concatenate([self.aux, more])
        if at.size:
            self.aux[self.xp.asarray(at)] = rows[self.xp.asarray(ok)]

    def take_rows(self, upto: int) -> np.ndarray:
        """The hidden states at [end, upto), given up (end moves to upto)."""
        rows, self.aux = self.aux[:upto - self.end], self.aux[upto - self.end:].copy()
        self.end = upto
        return rows


def keep_step_rows(states: dict, batch: ModelBatch, rows, new_state: Callable[[int], KeptRows]) -> None:
    """File a step's rows [T, width] by sequence and position into states (seq_id -> KeptRows); new_state(first):
    the state of a sequence seen for the first time, its rows from position `first`."""
    for i, s in enumerate(batch.seqs):
        q0, q1 = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        pos = batch.positions[q0:q1]
        if q1 == q0 or s.seq_id < 0 or pos[0] < 0:
            continue
        state = states.get(s.seq_id)
        if state is None:
            state = states[s.seq_id] = new_state(int(pos[0]))
        state.keep_rows(pos, rows[q0:q1])


def drop_states(states: dict, seq_ids: set[int]) -> list:
    """Drop the states of sequences not in seq_ids; the dropped states."""
    return [states.pop(sid) for sid in [s for s in states if s not in seq_ids]]


def greedy_drafts(hidden: dict, limits: Sequence[int], xp, tokens_of: Callable, step: Callable) -> list[list[int]]:
    """Up to limits[i] greedy drafts for each sequence i with a hidden input (hidden[i]: [1, H], its draft layer's
    last output). Per step, the drafts of every sequence's row at once (tokens_of: stacked rows -> target
    ids); then step(more, hidden, drafts, j): the next hidden input of each sequence in `more` (those that draft
    again: the layer run at num_computed + j on the draft just made, its KV row scratch)."""
    drafts: list[list[int]] = [[] for _ in limits]
    for j in range(max(limits, default=0)):
        rows = [i for i in hidden if j < limits[i]]
        if not rows:
            break
        for i, token in zip(rows, tokens_of(xp.concatenate([hidden[i] for i in rows]))):
            drafts[i].append(int(token))
        more = [i for i in rows if j + 1 < limits[i]]
        if more:
            hidden.update(step(more, hidden, drafts, j))
    return drafts
