"""An EAGLE-3 head drafting (float32): the `eagle3` proposer of the numpy and the GPU executors.

Per sequence (DraftState) the draft keeps the target's kept hidden states by position until the head has read
them (`aux`, fed after every step the sequence ran in: `take`) and the head layer's own KV by position (`kv`).
Before a decode step, `propose` first catches the head up over the positions the target computed since (`end`
to num_computed: hidden states of the target at p, token at p + 1 — both final, so these KV rows are the head's
committed ones), then runs k autoregressive head steps from num_computed - 1 on: the first token from the
catch-up's last row, each next from the head's own pre-norm output and the token it just drafted. Those steps'
KV rows lie at positions from num_computed on, past `end`: scratch, overwritten by the next catch-up whatever
the verification accepts or rejects — `end` is the rollback (the target's rejected rows are overwritten alike
before they are read).

A sequence's state starts at the first position the target computed for it (a prefix hit's cached positions
have no hidden states: the head attends from there); a state is dropped when its sequence leaves the running
set (`keep`: finished, aborted, preempted) and rebuilt from its next computed rows.

The arithmetic is array-module generic (`xp`: numpy on the numpy executor, CuPy on the GPU's, where the kept
hidden states arrive as bf16 bits and every array op is queued on the compute stream).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from engine.batch import ModelBatch
from engine.draft_rows import KeptRows, drop_states, greedy_drafts, keep_step_rows
from engine.eagle3 import Eagle3Head
from engine.executor.cpu_ops import rms, rope
from engine.executor.gpu_bf16 import bf16_to_f32
from engine.models.rope import rope_cos_sin
from engine.sequence import Sequence


@dataclass
class DraftState(KeptRows):
    kv: np.ndarray = None        # float32 [capacity, 2, Hkv, D]: the head's K and V at first + i

    def grow(self, upto: int) -> None:
        """KV room for positions below `upto`."""
        need = upto - self.first
        if need > len(self.kv):
            cap = max(need, 2 * len(self.kv))
            self.kv = self.xp.concatenate([self.kv, self.xp.zeros((cap - len(self.kv),) + self.kv.shape[1:],
                                                                  np.float32)])


class Eagle3Draft:
    """The DraftProposer of an EAGLE-3 head (engine/ngram.py's protocol) over the target's kept hidden states."""

    def __init__(self, head: Eagle3Head, target_embed, max_model_len: int, xp=np, stream=None):
        """target_embed: the target's embedding (float32, or bf16 bits on the GPU), used where the head ships
        none; xp: the module of the head's weights (head.weights are numpy: uploaded here where xp is not);
        stream: the CuPy stream every array op is queued on (None: numpy's, none)."""
        self.head, self.cfg, self.xp = head, head.config, xp
        self.stream = stream if stream is not None else contextlib.nullcontext()
        with self.stream:
            self.w = {k: xp.asarray(v) for k, v in head.weights.items()}
            self.cos, self.sin = (xp.asarray(a) for a in rope_cos_sin(self.cfg, max_model_len + 1))
        self.to_target = head.weights["draft_to_target"]                 # host: the drafts go to the host
        self.embed = self.w.get("embed_tokens", target_embed)
        self.states: dict[int, DraftState] = {}

    def take(self, batch: ModelBatch, kept: dict) -> None:
        """Keep a step's hidden states (kept[layer]: [T, Ht] entering that target layer, float32 or bf16 bits)
        by sequence and position."""
        with self.stream:
            self._take(batch, kept)

    def _take(self, batch: ModelBatch, kept: dict) -> None:
        xp, c = self.xp, self.cfg
        aux = xp.concatenate([bf16_to_f32(xp, kept[layer]) for layer in self.head.aux_layers], axis=-1)
        keep_step_rows(self.states, batch, aux, lambda first: DraftState(
            first=first, end=first, aux=xp.zeros((0, aux.shape[1]), np.float32), xp=xp,
            kv=xp.zeros((0, 2, c.num_key_value_heads, c.head_dim), np.float32)))

    def keep(self, seq_ids: set[int]) -> None:
        """Drop the states of sequences not in seq_ids."""
        drop_states(self.states, seq_ids)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        with self.stream:
            return self._propose(seqs, limits)

    def _propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Each sequence's head caught up, then k head steps, the lm_head of every sequence's step in one GEMM."""
        states = [self._caught_up(s, k) for s, k in zip(seqs, limits)]
        return greedy_drafts({i: st.last[None] for i, st in enumerate(states) if st is not None}, limits, self.xp,
                             lambda rows: [self.to_target[t] for t in self._tokens(rows)],
                             lambda more, hidden, drafts, j: {
                                 i: self._layer(states[i], hidden[i], np.array(drafts[i][-1:]),
                                                np.array([seqs[i].num_computed + j])) for i in more})

    def _caught_up(self, seq: Sequence, k: int) -> DraftState | None:
        """seq's state with the head's KV over every position the target computed (None: no hidden states)."""
        state, done = self.states.get(seq.seq_id), seq.num_computed
        if state is None or done <= state.first:
            return None
        state.grow(done + k)
        if done > state.end:
            pos = np.arange(state.end, done)
            tokens = np.asarray(seq.token_ids[state.end + 1:done + 1], np.int64)   # pos, tokens: host arrays
            hidden = state.take_rows(done) @ self.w["fc"].T
            state.last = self._layer(state, hidden, tokens, pos)[-1]
        return state

    def _tokens(self, prenorm) -> list[int]:
        """The draft ids the head's lm_head gives its (final-normed) output rows (on the host)."""
        normed = rms(prenorm, self.w["norm"], self.cfg.rms_norm_eps)
        return self.xp.argmax(normed @ self.w["lm_head"].T, axis=-1).tolist()

    def _layer(self, state: DraftState, hidden, tokens: np.ndarray, pos: np.ndarray):
        """The head's decoder layer at positions pos (hidden inputs [n, H], the tokens after them): writes its KV
        there, attends causally from state.first; returns the pre-norm output [n, H]."""
        xp, w, c, eps = self.xp, self.w, self.cfg, self.cfg.rms_norm_eps
        embedded = rms(bf16_to_f32(xp, self.embed[xp.asarray(tokens)]), w["input_layernorm"], eps)
        normed = rms(hidden, w["hidden_norm"], eps)
        residual = normed if self.head.norm_before_residual else hidden
        qkv = xp.concatenate([embedded, normed], axis=-1) @ w["qkv_proj"].T
        n, D, Hq, Hkv = len(pos), c.head_dim, c.num_attention_heads, c.num_key_value_heads
        p = xp.asarray(pos)
        cos, sin = self.cos[p], self.sin[p]
        q = rope(qkv[:, :Hq * D].reshape(n, Hq, D), cos, sin)
        k = rope(qkv[:, Hq * D:(Hq + Hkv) * D].reshape(n, Hkv, D), cos, sin)
        at = p - state.first
        state.kv[at, 0], state.kv[at, 1] = k, qkv[:, (Hq + Hkv) * D:].reshape(n, Hkv, D)
        h = _attend(xp, q, state.kv[:int(pos[-1]) - state.first + 1], at, D ** -0.5) @ w["o_proj"].T + residual
        act = rms(h, w["post_attention_layernorm"], eps) @ w["gate_up_proj"].T
        gate, up = xp.split(act, 2, axis=-1)
        return (gate / (1 + xp.exp(-gate)) * up) @ w["down_proj"].T + h


def _attend(xp, q, kv, rows, scale: float):
    """Causal GQA attention of q [n, Hq, D] at rows over kv [L, 2, Hkv, D] (row r sees rows <= r): [n, Hq·D]."""
    n, Hq, D = q.shape
    Hkv = kv.shape[2]
    q4 = q.reshape(n, Hkv, Hq // Hkv, D)            # query head h·G + g reads kv head h (GQA), no repeated K / V
    scores = xp.einsum("nkgd,lkd->kgnl", q4, kv[:, 0]) * np.float32(scale)
    scores = xp.where(xp.arange(len(kv))[None, None, None, :] <= rows[None, None, :, None], scores,
                      np.float32(-np.inf))
    p = xp.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return xp.einsum("kgnl,lkd->nkgd", p, kv[:, 1]).reshape(n, Hq * D)
