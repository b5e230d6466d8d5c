"""An EAGLE-3 head drafting on the host (numpy, float32): the numpy executor's `eagle3` proposer.

Per sequence (DraftState) the draft keeps the target's kept hidden states by position until the head has read
them (`aux`, fed after every step the sequence ran in: `take`) and the head layer's own KV by position (`kv`). Before a decode step,
`propose` first catches the head up over the positions the target computed since (`end` to num_computed: hidden
states of the target at p, token at p + 1 — both final, so these KV rows are the head's committed ones), then
runs k autoregressive head steps from num_computed - 1 on: the first token from the catch-up's last row, each
next from the head's own pre-norm output and the token it just drafted. Those steps' KV rows lie at positions
from num_computed on, past `end`: scratch, overwritten by the next catch-up whatever the verification accepts
or rejects — `end` is the rollback (the target's rejected rows are overwritten alike before they are read).

A sequence's state starts at the first position the target computed for it (a prefix hit's cached positions
have no hidden states: the head attends from there); a state is dropped when its sequence leaves the running
set (`keep`: finished, aborted, preempted) and rebuilt from its next computed rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.batch import ModelBatch
from engine.eagle3 import Eagle3Head
from engine.executor.cpu_ops import _rms, _rope
from engine.models.rope import rope_cos_sin
from engine.sequence import Sequence


@dataclass
class DraftState:
    first: int                   # the first position with the target's hidden states
    end: int                     # the head's committed KV covers [first, end)
    aux: np.ndarray              # float32 [n, 3 Ht]: the target's kept hidden states at end + i (not yet read)
    kv: np.ndarray               # float32 [capacity, 2, Hkv, D]: the head's K and V at first + i
    last: np.ndarray | None = None   # the head's pre-norm output at end - 1 (the next draft's hidden input)

    def keep_rows(self, pos: np.ndarray, rows: np.ndarray) -> None:
        """The target's hidden states `rows` at positions `pos` (those below `end` are read already)."""
        ok = pos >= self.end
        at = pos[ok] - self.end
        if at.size and at.max() >= len(self.aux):
            self.aux = np.concatenate([self.aux, np.zeros((at.max() + 1 - len(self.aux), self.aux.shape[1]),
                                                          np.float32)])
        self.aux[at] = rows[ok]

    def take_rows(self, upto: int) -> np.ndarray:
        """The hidden states at [end, upto), given up (end moves to upto)."""
        rows, self.aux = self.aux[:upto - self.end], self.aux[upto - self.end:].copy()
        self.end = upto
        return rows

    def grow(self, upto: int) -> None:
        """KV room for positions below `upto`."""
        need = upto - self.first
        if need > len(self.kv):
            cap = max(need, 2 * len(self.kv))
            self.kv = np.concatenate([self.kv, np.zeros((cap - len(self.kv),) + self.kv.shape[1:], np.float32)])


class NumpyEagle3Draft:
    """The DraftProposer of an EAGLE-3 head over a numpy target (engine/ngram.py's protocol)."""

    def __init__(self, head: Eagle3Head, target_embed: np.ndarray, max_model_len: int):
        self.head, self.cfg, self.w = head, head.config, head.weights
        self.embed = self.w.get("embed_tokens", target_embed)
        self.cos, self.sin = rope_cos_sin(self.cfg, max_model_len + 1)
        self.states: dict[int, DraftState] = {}

    def take(self, batch: ModelBatch, kept: dict[int, np.ndarray]) -> None:
        """Keep a step's hidden states (kept[layer]: [T, Ht] entering that target layer) by sequence and position."""
        aux = np.concatenate([kept[layer] for layer in self.head.aux_layers], axis=-1)
        c = self.cfg
        for i, s in enumerate(batch.seqs):
            q0, q1 = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            if q1 == q0:
                continue
            pos = batch.positions[q0:q1]
            state = self.states.get(s.seq_id)
            if state is None:
                state = self.states[s.seq_id] = DraftState(
                    first=int(pos[0]), end=int(pos[0]), aux=np.zeros((0, aux.shape[1]), np.float32),
                    kv=np.zeros((0, 2, c.num_key_value_heads, c.head_dim), np.float32))
            state.keep_rows(pos, aux[q0:q1])

    def keep(self, seq_ids: set[int]) -> None:
        """Drop the states of sequences not in seq_ids."""
        for sid in [s for s in self.states if s not in seq_ids]:
            del self.states[sid]

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Each sequence's head caught up, then k head steps, the lm_head of every sequence's step in one GEMM."""
        states = [self._caught_up(s, k) for s, k in zip(seqs, limits)]
        drafts: list[list[int]] = [[] for _ in seqs]
        hidden = {i: st.last[None] for i, st in enumerate(states) if st is not None}
        for j in range(max(limits, default=0)):
            rows = [i for i in hidden if j < limits[i]]
            if not rows:
                break
            tokens = self._tokens(np.concatenate([hidden[i] for i in rows]))
            for i, token in zip(rows, tokens):
                drafts[i].append(int(self.w["draft_to_target"][token]))
                if j + 1 < limits[i]:                   # the next step: scratch KV at position num_computed + j
                    hidden[i] = self._layer(states[i], hidden[i], np.array(drafts[i][-1:]),
                                            np.array([seqs[i].num_computed + j]))
        return drafts

    def _caught_up(self, seq: Sequence, k: int) -> DraftState | None:
        """seq's state with the head's KV over every position the target computed (None: no hidden states)."""
        state, done = self.states.get(seq.seq_id), seq.num_computed
        if state is None or done <= state.first:
            return None
        state.grow(done + k)
        if done > state.end:
            pos = np.arange(state.end, done)
            hidden = state.take_rows(done) @ self.w["fc"].T
            state.last = self._layer(state, hidden, np.asarray(seq.token_ids, np.int64)[pos + 1], pos)[-1]
        return state

    def _tokens(self, prenorm: np.ndarray) -> np.ndarray:
        """The draft ids the head's lm_head gives its (final-normed) output rows."""
        normed = _rms(prenorm, self.w["norm"], self.cfg.rms_norm_eps)
        return np.argmax(normed @ self.w["lm_head"].T, axis=-1)

    def _layer(self, state: DraftState, hidden: np.ndarray, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The head's decoder layer at positions pos (hidden inputs [n, H], the tokens after them): writes its KV
        there, attends causally from state.first; returns the pre-norm output [n, H]."""
        w, c, eps = self.w, self.cfg, self.cfg.rms_norm_eps
        embedded = _rms(self.embed[tokens], w["input_layernorm"], eps)
        normed = _rms(hidden, w["hidden_norm"], eps)
        residual = normed if self.head.norm_before_residual else hidden
        qkv = np.concatenate([embedded, normed], axis=-1) @ w["qkv_proj"].T
        n, D, Hq, Hkv = len(pos), c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = _rope(qkv[:, :Hq * D].reshape(n, Hq, D), self.cos[pos], self.sin[pos])
        k = _rope(qkv[:, Hq * D:(Hq + Hkv) * D].reshape(n, Hkv, D), self.cos[pos], self.sin[pos])
        rows = pos - state.first
        state.kv[rows, 0], state.kv[rows, 1] = k, qkv[:, (Hq + Hkv) * D:].reshape(n, Hkv, D)
        h = _attend(q, state.kv[:rows[-1] + 1], rows, D ** -0.5) @ w["o_proj"].T + residual
        act = _rms(h, w["post_attention_layernorm"], eps) @ w["gate_up_proj"].T
        gate, up = np.split(act, 2, axis=-1)
        return (gate / (1 + np.exp(-gate)) * up) @ w["down_proj"].T + h


def _attend(q: np.ndarray, kv: np.ndarray, rows: np.ndarray, scale: float) -> np.ndarray:
    """Causal GQA attention of q [n, Hq, D] at rows over kv [L, 2, Hkv, D] (row r sees rows <= r): [n, Hq·D]."""
    n, Hq, D = q.shape
    group = Hq // kv.shape[2]
    keys, values = np.repeat(kv[:, 0], group, axis=1), np.repeat(kv[:, 1], group, axis=1)   # [L, Hq, D]
    scores = np.einsum("nhd,lhd->hnl", q, keys) * np.float32(scale)
    scores = np.where(np.arange(len(kv))[None, None, :] <= rows[None, :, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", p, values).reshape(n, Hq * D).astype(np.float32)
