"""Sequence: one sample of one request as the scheduler tracks it (tokens, KV blocks, progress)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from memory.kv_pool import BLOCK_SIZE
from engine.request import SamplingParams
from memory.prefix_hash import NO_PARENT, hash_chain

_SEED_STRIDE = 0x9E3779B97F4A7C15


def sample_seed(base_seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with base_seed (sample 0 keeps it)."""
    return (base_seed + index * _SEED_STRIDE) % (1 << 63)


class SeqStatus(Enum):
    WAITING = "waiting"
    LOADING = "loading"         # admitted; its prefix is still being copied back from the host KV tier
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """token_ids holds prompt + output; the first num_computed of them have KV in block_table.

    A request with n > 1 starts as one sequence with fork_count = n: it prefills the prompt's
    full blocks up to fork_at, then forks into n sequences that share those blocks.
    `params` are the effective ones: a concrete seed, EOS folded into stop_token_ids."""
    seq_id: int
    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    index: int = 0
    lora_id: int = 0
    arrival: float = 0.0
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    fork_count: int = 1
    want_prompt_logprobs: bool = False
    num_cached_tokens: int = 0
    kv_from: int = 0                     # positions below it hold KV restored by a prefix hit: never written again
                                         # (a line with state recomputes the last ones: engine/seq_state.py)
    state_slot: int = -1                 # its state slot (lines with per-sequence state; -1: none)
    fork_early: bool = False             # n > 1 forks before any prefill (per-sequence state no replay rebuilds)
    spare_slots: list[int] = field(default_factory=list)   # n > 1 of a line that replays: its samples' state slots
    grammar: Any = None             # structured output: a GrammarMatcher, advanced with each token
    load: Any = None                # LOADING: its restore's Copies (engine/scheduler.py) until they land
    cow_source: int = -1            # a partial prefix hit's cached block (memory/block_manager.py partial_hit),
                                    # copied into its own before its first step; held until that step is done
    draft_ids: list[int] = field(default_factory=list)   # speculative decoding: drafts for its next step
    # the prompt as an int array (the request's own, or prompt_tokens()): hashed without converting token_ids
    prompt_array: np.ndarray | None = field(default=None, repr=False, compare=False)
    _hashes: list[int] = field(default_factory=list)
    _table_list: list[int] | None = field(default=None, repr=False, compare=False)
    _table_array: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False, compare=False)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def fork_at(self) -> int:
        """Tokens to prefill before forking: the prompt's full blocks, leaving >= 1 token.
        Only sample 0 computes prompt logprobs (the others skip them), so such requests fork
        right away, and so do samples that keep per-sequence state a replay cannot rebuild (fork_early: a
        state slot cannot be shared; a line that replays forks after the prefill, each sample replaying the
        last tokens into its own slot)."""
        if self.want_prompt_logprobs or self.fork_early:
            return 0
        return (self.prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE

    def seed_hashes(self, hashes: list[int]) -> None:
        """Take the hashes of this sequence's leading full blocks computed elsewhere (memory/prefix_hash.py
        RecentChains: the same tokens seen in a recent prompt) before any of its own are."""
        if not self._hashes:
            self._hashes = list(hashes)

    def prompt_tokens(self) -> np.ndarray:
        """The prompt as an int array (the request's own, or converted from token_ids once)."""
        if self.prompt_array is None:
            self.prompt_array = np.asarray(self.token_ids[:self.prompt_len], np.int32)
        return self.prompt_array

    def block_hashes(self, num_blocks: int, tokens: list[int] | None = None) -> list[int]:
        """Prefix-cache hashes of the first num_blocks full blocks (memoized; tokens of a full
        block never change). tokens: the sequence's tokens where token_ids does not hold them all yet
        (a verify step's accepted drafts, appended after the scheduler accounts the step)."""
        tokens = self.token_ids if tokens is None else tokens
        have = len(self._hashes)
        if have < num_blocks:
            assert num_blocks * BLOCK_SIZE <= len(tokens), "hash of a partial block"
            parent = self._hashes[-1] if self._hashes else NO_PARENT
            src = self.prompt_array if self.prompt_array is not None and num_blocks * BLOCK_SIZE <= len(
                self.prompt_array) else tokens
            self._hashes += hash_chain(src[have * BLOCK_SIZE:num_blocks * BLOCK_SIZE], BLOCK_SIZE, self.lora_id, parent)
        return self._hashes[:num_blocks]

    def block_table_array(self) -> np.ndarray:
        """block_table as an int32 array, extended as the list grows: a block table only grows in
        place (allocation) or is replaced (preemption, finish), so a step's batch need not convert
        every table from Python ints again (long contexts: ~100 blocks per sequence)."""
        table, have = self.block_table, len(self._table_array)
        if table is not self._table_list or len(table) < have:
            self._table_list, self._table_array = table, np.asarray(table, np.int32)
        elif len(table) > have:
            self._table_array = np.concatenate([self._table_array, np.asarray(table[have:], np.int32)])
        return self._table_array

    def fork(self, seq_id: int, index: int) -> "Sequence":
        """Sample `index` of this (sample-0) sequence, at the same progress. The scheduler
        shares the blocks and bumps their refcounts."""
        params = dataclasses.replace(self.params, seed=sample_seed(self.params.seed, index))
        return dataclasses.replace(
            self, seq_id=seq_id, index=index, params=params, token_ids=list(self.token_ids),
            block_table=list(self.block_table), fork_count=1, want_prompt_logprobs=False,
            state_slot=-1, spare_slots=[], _hashes=list(self._hashes), draft_ids=[],
            grammar=self.grammar.fork() if self.grammar is not None else None)
