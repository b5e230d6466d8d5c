"""An MTP layer drafting on the numpy executor (engine/mtp.py's module, float32): the `mtp` proposer.

Per sequence (MtpState) the draft keeps the target's final-normed hidden states by position until the layer has
read them (engine/draft_rows.py; the executor hands them over as keeper layer FINAL) and the layer's own KV in a
small paged pool of its own (MtpPool: one layer of the target's KV layout, its blocks handed to sequences as they
grow). Before a decode step, `propose` catches the layer up over the positions the target computed since (`end` to
num_computed: the target's hidden state at i and the token at i + 1, both final, so those KV rows are committed),
then drafts k tokens greedily: the first from the catch-up's last output, each next by the same layer applied again
at the next position on its own output h' and the token it just drafted — vLLM's recursion when
num_speculative_tokens exceeds the modules. Those steps' KV rows lie at positions from num_computed on, past
`end`: scratch, overwritten by the next catch-up whatever the verification accepts (rollback as the EAGLE-3
draft's). A sequence's state starts at the first position the target computed for it (a prefix hit's cached
positions have no hidden states: the layer attends from there) and is dropped when the sequence leaves the running
set.

The block runs through the target line's own forward pieces (its `mtp_block`: DeepSeek's MLA block and MLP /
MoE, Qwen3.5's gated attention and MLP) over NumpyOps on the private pool, whose one layer every layer index reads
(the pool's layer stride is 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from engine.batch import ModelBatch, SeqStep
from engine.draft_rows import FINAL, KeptRows, drop_states, greedy_drafts, keep_step_rows
from engine.executor.cpu_ops import CpuStepContext, NumpyOps
from engine.models.decoder import DecoderLM
from engine.mtp import MtpLayer
from engine.sequence import Sequence
from memory.kv_pool import BLOCK_SIZE, KVLayout, blocks_for


@dataclass
class MtpState(KeptRows):
    blocks: list[int] = field(default_factory=list)     # the pool's blocks of positions first, first + 16, ...


class MtpPool:
    """The MTP layer's own paged KV (one layer of the target's KV layout), grown by doubling."""

    def __init__(self, layer: int, layout: KVLayout, blocks: int = 16):
        self.layer = layer
        self.kv = np.zeros(replace(layout, layers=1).pool_shape(blocks), np.float32)
        self.free = list(range(blocks))

    def view(self) -> np.ndarray:
        """The pool as a [layer + 1, ...] array whose every layer is its one (what NumpyOps indexes)."""
        return np.lib.stride_tricks.as_strided(self.kv, (self.layer + 1,) + self.kv.shape[1:],
                                               (0,) + self.kv.strides[1:])

    def reserve(self, blocks: list[int], need: int) -> bool:
        """Extend `blocks` to `need` blocks; True where the pool grew (its arrays replaced)."""
        grew = False
        while len(self.free) < need - len(blocks):
            n = self.kv.shape[2] // BLOCK_SIZE
            self.kv = np.concatenate([self.kv, np.zeros_like(self.kv)], axis=2)
            self.free += list(range(n, 2 * n))
            grew = True
        while len(blocks) < need:
            blocks.append(self.free.pop())
        return grew


class MtpDraft:
    """The DraftProposer (engine/ngram.py's protocol) of an MTP layer over the target's kept hidden states."""

    def __init__(self, model: DecoderLM, mtp: MtpLayer, weights: dict, embed: np.ndarray, cos: np.ndarray,
                 sin: np.ndarray):
        """weights: the module's (mtp.weights, as the executor prepared them); embed: the target's embedding;
        cos / sin: the target's rotary tables."""
        self.model, self.layer, self.module, self.w, self.embed = model, mtp.layer, mtp.module, weights, embed
        self.cos, self.sin, self.eps = cos, sin, model.config.rms_norm_eps
        self.pool = MtpPool(mtp.layer, model.kv_layout())
        self.ops = NumpyOps(self.pool.view(), model.op_families)
        self.states: dict[int, MtpState] = {}

    def take(self, batch: ModelBatch, kept: dict) -> None:
        """Keep a step's final-normed hidden states (kept[FINAL]: [T, H]) by sequence and position."""
        rows = kept[FINAL]
        keep_step_rows(self.states, batch, rows, lambda first: MtpState(
            first=first, end=first, aux=np.zeros((0, rows.shape[1]), np.float32)))

    def keep(self, seq_ids: set[int]) -> None:
        """Drop the states of sequences not in seq_ids, their blocks back to the pool."""
        for state in drop_states(self.states, seq_ids):
            self.pool.free += state.blocks

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Each sequence's layer caught up (one batched pass), then k greedy drafts, each step batched."""
        states = self._caught_up(seqs, limits)

        def step(more, hidden, drafts, j):
            out = self._layer([(states[i], hidden[i], drafts[i][-1:], [seqs[i].num_computed + j]) for i in more])
            return {i: out[n:n + 1] for n, i in enumerate(more)}
        return greedy_drafts({i: st.last[None] for i, st in enumerate(states) if st is not None}, limits, np,
                             self._tokens, step)

    def _caught_up(self, seqs: list[Sequence], limits: list[int]) -> list[MtpState | None]:
        """Each sequence's state with the layer's KV over every position the target computed (None: no hidden
        states), KV blocks reserved for its k draft steps."""
        states, items = [], []
        for seq, k in zip(seqs, limits):
            state, done = self.states.get(seq.seq_id), seq.num_computed
            if state is None or done <= state.first:
                states.append(None)
                continue
            states.append(state)
            if self.pool.reserve(state.blocks, blocks_for(done + k - state.first)):
                self.ops = NumpyOps(self.pool.view(), self.model.op_families)
            if done > state.end:
                start = state.end
                items.append((state, state.take_rows(done), seq.token_ids[start + 1:done + 1], range(start, done)))
        if items:
            out, ends = self._layer(items), np.cumsum([len(pos) for *_, pos in items])
            for (state, *_), e in zip(items, ends):
                state.last = out[e - 1]
        return states

    def _tokens(self, out: np.ndarray) -> list[int]:
        """The greedy draft of each output row h': argmax of head(norm(h')) (DeepSeek's shared_head), or of
        head(h') where the block's output is normed already (Qwen3.5)."""
        if self.module.head_norm:
            out, _ = self.ops.rms_norm(out, self.w["mtp.norm"], self.eps)
        return [int(t) for t in np.argmax(self.ops.logits(out, self.w["mtp.head"]), axis=-1)]

    def _layer(self, items: list[tuple]) -> np.ndarray:
        """The module at each item's positions (state, hidden [n, H], the n tokens after them, n positions):
        writes its KV there, attends causally from the state's first position; the outputs h' [sum n, H]."""
        ops, w, eps = self.ops, self.w, self.eps
        tokens = np.concatenate([np.asarray(t, np.int64) for _, _, t, _ in items])
        positions = np.concatenate([np.asarray(pos, np.int64) for *_, pos in items])
        embedding = self.embed[tokens]
        if self.module.masks_first:
            embedding = np.where((positions == 0)[:, None], np.float32(0), embedding)
        embedded, _ = ops.rms_norm(embedding, w["mtp.enorm"], eps)
        hidden, _ = ops.rms_norm(np.concatenate([h for _, h, _, _ in items]), w["mtp.hnorm"], eps)
        x = ops.linear(np.concatenate([embedded, hidden], axis=-1), w["mtp.eh_proj"])
        ctx = self._context(items, positions)
        return np.asarray(self.model.mtp_block(ops, w, x, self.layer, ctx), np.float32)

    def _context(self, items: list[tuple], positions: np.ndarray) -> CpuStepContext:
        """A step over the private pool: each item's positions relative to its state's first (its block table's),
        the rotary at the absolute ones (`positions`, every item's in turn)."""
        steps = [SeqStep(-1, [0] * len(pos), pos[0] - state.first, state.blocks, False) for state, _, _, pos in items]
        return CpuStepContext(ModelBatch.build(steps), self.cos[positions], self.sin[positions])
