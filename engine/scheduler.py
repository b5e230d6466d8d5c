"""Continuous-batching scheduler: FCFS, chunked prefill mixed with decodes under a token
budget, preemption by recompute when KV blocks run out, n > 1 by forking after prefill.

Each step: running sequences first (oldest first; a decode costs 1 token, an unfinished prefill the rest of its
prompt up to the budget), preempting the youngest running sequence whenever blocks run out; then, if nothing was
preempted, waiting sequences join while the budget, max_num_seqs and the KV pool allow (one whose LoRA adapter
would be one more than max_loras among the running is passed over, keeping its place). A waiting sequence starts
from its longest prefix-cache hit: device blocks first, then blocks evicted to the host KV tier (engine/host_tier.py),
copied back before the step (or while it waits LOADING); then a partial hit (memory/block_manager.py), where the
executor supports_block_copies: a prompt sent again computes one token, not 16.

A line with per-sequence state gives the scheduler its StateSlots, held by its part engine/seq_state.py (slots
taken and given back, a replay after a prefix hit, n > 1 samples); such a line never re-feeds a prompt-logprobs
chunk's last token (the executor scores the next prompt token instead) and takes no partial-block hits.

While a decode step runs, the next one can be planned ahead (plan_decode_ahead: the same sequences, one token
further, blocks reserved) and confirmed once the step's tokens are in (confirm_decode_ahead), so the host's
scheduling overlaps the device.

Speculative decoding (engine/speculator.py): a decoding sequence with draft_ids feeds its last token and as
many drafts as the step budget leaves (a verify step, SeqStep.num_drafts): tokens, less one for each running
sequence after it and MIN_PREFILL for a waiting prompt, and time (the drafts are cut to it, the decode never
is; a verify step is no prefill: the first prefill chunk's MIN_PREFILL stands); KV blocks for all of them. After
the step (advance, told how many drafts each step accepted) only the accepted positions count as computed: the
rejected ones' slots are written over later, blocks that hold nothing but rejected positions past the next
token's are freed, and only blocks full of accepted tokens are hashed into the prefix cache.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.batch import SeqStep
from engine.host_tier import HostTier
from engine.limits import StepLimits
from engine.seq_state import SequenceState
from engine.sequence import Sequence, SeqStatus
from engine.step_budget import MIN_PREFILL, StepBudget, StepCost
from memory.block_manager import BlockManager
from memory.kv_pool import BLOCK_SIZE, blocks_for
from memory.prefix_hash import NO_PARENT, RecentChains
from memory.state_slots import StateSlots


def counts_history(p) -> bool:
    """The sampling of these params reads the tokens generated so far (repetition / frequency / presence
    penalties): a step planned before the previous token is known would sample without it."""
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


@dataclass
class SchedulerOutput:
    steps: list[SeqStep] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)         # parallel to steps
    admitted: list[Sequence] = field(default_factory=list)     # left waiting this step
    preempted: list[Sequence] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)       # new samples of n > 1 requests

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.steps)


class Scheduler:
    def __init__(self, block_manager: BlockManager, limits: StepLimits, host_tier: HostTier | None = None,
                 state_slots: StateSlots | None = None, max_loras: int = 0, step_cost: StepCost | None = None,
                 replay: Callable[[int], int] | None = None):
        self.bm = block_manager
        self.state = SequenceState(state_slots, replay)   # per-sequence state slots (engine/seq_state.py)
        self.step_cost = step_cost               # the executor's cost model: time bounds chunks too (step_budget.py)
        self.max_loras = max_loras               # > 0: at most this many LoRA adapters among the running
        self.chunked_prefill = limits.chunked_prefill   # off: a prompt's prefill runs in one step or waits
        self.host_tier = host_tier               # its host KV tier part (engine/host_tier.py; None: off)
        self.limits = limits                     # resolved once at start (engine/limits.py), the executor's too
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []        # admitted, their host-tier restores in flight
        self.copy_on_write = False                # the executor copies blocks (supports_block_copies): partial hits
        self.num_preemptions = 0
        self._next_seq_id = 0
        self.recent_chains = RecentChains(BLOCK_SIZE)    # prompts sharing a prefix hash only their new blocks

    @property
    def state_slots(self) -> StateSlots | None:
        """The line's per-sequence state slots (None: it keeps none)."""
        return self.state.slots

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        seq.fork_early = self.state.forks_early
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or (self.host_tier and self.host_tier.holds_blocks))

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.new_budget()
        self.land_copies()
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget, reserve=len(self.running) - i - 1 + MIN_PREFILL * bool(self.waiting))
            if n and not self._reserve(seq, n, out):
                break                                    # seq preempted itself
            if n:
                self._add_step(seq, n, out, budget)
            i += 1
        if out.preempted:
            return out
        self._admit_waiting(out, budget)
        return out

    def new_budget(self) -> StepBudget:
        """A step's budget: max_num_batched_tokens tokens, and a time under the executor's StepCost."""
        return StepBudget.of(self.max_num_batched_tokens, self.step_cost if self.chunked_prefill else None)

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget, in_flight: frozenset[int] = frozenset()) -> None:
        """Waiting sequences join `out` (FCFS) while the token budget, max_num_seqs and the KV pool allow;
        a sequence whose LoRA adapter cannot join is passed over, keeping its place. in_flight: hashes of
        blocks the step still running fills (a plan ahead): a sequence whose next block is one of them
        waits for it to be cached instead of computing it again."""
        loras, skipped = self._running_loras(), []
        while self.waiting and budget.tokens > 0:
            seq = self.waiting[0]
            if self._lora_blocked(seq, loras):     # its adapter cannot join this step's; a later one may
                skipped.append(self.waiting.popleft())
                continue
            if len(self.running) + len(self.loading) + seq.fork_count > self.max_num_seqs:
                break
            if not self._admit(seq, budget, out, in_flight):
                break
            self.waiting.popleft()
            if seq.lora_id:
                loras.add(seq.lora_id)
            if seq.status is SeqStatus.LOADING:          # joins when its copies land
                continue
            group = self._fork(seq, out) if self._fork_ready(seq) else [seq]
            for s in group:
                n = self._chunk(s, budget) if budget.tokens > 0 else 0
                need = blocks_for(s.num_computed + n) - len(s.block_table)
                if n > 0 and self.bm.can_allocate(need):
                    s.block_table += self.bm.allocate(need)
                    self._add_step(s, n, out, budget)
        self.waiting.extendleft(reversed(skipped))

    def _running_loras(self) -> set[int]:
        """The LoRA adapters (ids) among the running sequences (none tracked without max_loras)."""
        return {s.lora_id for s in self.running + self.loading if s.lora_id} if self.max_loras else set()

    def _lora_blocked(self, seq: Sequence, loras: set[int]) -> bool:
        """seq's adapter would be one more than max_loras among the running sequences' `loras` (a step's
        adapters must all be resident in the executor's slots at once)."""
        return bool(self.max_loras and seq.lora_id and seq.lora_id not in loras and len(loras) >= self.max_loras)

    def _chunk(self, seq: Sequence, budget: StepBudget, reserve: int = 0) -> int:
        """New tokens of seq to compute this step (0: none fit). reserve: tokens a verify step's drafts leave
        to the running sequences after seq (a token each) and to a waiting prompt's first chunk."""
        if seq.draft_ids:                    # a decode and its drafts: as many drafts as the budget leaves
            return budget.fit_verify(seq.num_computed, len(seq.draft_ids), reserve)
        end = seq.fork_at if seq.fork_count > 1 else len(seq.token_ids)
        left, overlap = end - seq.num_computed, self._overlap(seq)
        if not self.chunked_prefill:
            return left if left + overlap <= budget.tokens else 0
        n = budget.fit(seq.num_computed - overlap, left + overlap, MIN_PREFILL + overlap) - overlap
        # Prompt logprobs: a chunk after the first re-feeds the previous chunk's last token (overlap), so
        # that the logprob of its own first token is computed too. That re-written slot must not
        # sit in a full (hence possibly cached and shared) block: no chunk but the last may end
        # on a block boundary.
        if seq.want_prompt_logprobs and seq.num_computed + n < end and (seq.num_computed + n) % BLOCK_SIZE == 0:
            n -= 1
        return max(n, 0)

    def _overlap(self, seq: Sequence) -> int:
        """1 where a prompt-logprobs chunk re-feeds the previous chunk's last token (not with state)."""
        return int(self.state_slots is None and seq.want_prompt_logprobs and 0 < seq.num_computed < seq.prompt_len)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for n more tokens of a running seq, preempting the youngest running
        sequences as needed. False if seq itself had to go."""
        need = blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need <= 0:                # the tokens fit the last block (a decode, 15 steps of 16)
            return True
        while not self.bm.can_allocate(need):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table += self.bm.allocate(need)
        return True

    def _admit(self, seq: Sequence, budget: StepBudget, out: SchedulerOutput, in_flight: frozenset[int] = frozenset()) -> bool:
        """Move a waiting seq to running with its prefix-cache hit (device, then host tier), if its
        first chunk fits and its next block is not being filled by a step in flight (in_flight)."""
        hit: list[int] = []
        host: list[int] = []
        hashes: list[int] = []
        tier = self.host_tier if self.host_tier is not None and self.host_tier.on else None
        if not seq.want_prompt_logprobs and (self.bm.enable_prefix_caching or tier is not None):
            limit = (len(seq.token_ids) - 1) // BLOCK_SIZE
            if seq.fork_count > 1:
                limit = seq.fork_at // BLOCK_SIZE
            tokens = seq.prompt_tokens()
            seq.seed_hashes(self.recent_chains.reuse(tokens, seq.lora_id)[:limit])
            hashes = seq.block_hashes(limit)
            self.recent_chains.remember(tokens, seq.lora_id, hashes)
            hit = self.bm.lookup(hashes)                 # [] with prefix caching off (pure-host mode)
            if len(hit) < len(hashes) and hashes[len(hit)] in in_flight:
                return False                             # cached once the step in flight is done
            if tier is not None:
                host = tier.lookup(hashes[len(hit):])
        seq.num_computed = (len(hit) + len(host)) * BLOCK_SIZE
        no_cow = seq.want_prompt_logprobs or host or self.state_slots is not None
        cow = -1 if no_cow else self._partial_hit(seq, hashes, len(hit))
        self.state.rebuild(seq)
        n = self._chunk(seq, budget)
        need = max(blocks_for(seq.num_computed + n), len(hit) + len(host)) - len(hit)   # a replay reads the hit
        # blocks taken from the LRU by the hit itself no longer count as free
        lru_hits = sum(self.bm.ref_counts[b] == 0 for b in hit + [cow] if b >= 0)
        if need + lru_hits > self.bm.num_free_blocks or (n == 0 and not self._fork_ready(seq)) or \
                not self.state.has_room(seq):
            seq.num_computed = seq.kv_from = 0
            return False
        self.bm.acquire(hit + [cow] if cow >= 0 else hit)
        seq.block_table, seq.cow_source = list(hit), cow
        if host:
            tier.restore(seq, hashes, len(hit), host, may_load=seq.fork_count == 1 and self.state_slots is None)
        self.bm.record_query(len(seq.token_ids), seq.num_computed)
        seq.num_cached_tokens = seq.num_computed
        self.state.take(seq)
        out.admitted.append(seq)
        if seq.load is not None:
            seq.status = SeqStatus.LOADING
            self.loading.append(seq)
            return True
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def _partial_hit(self, seq: Sequence, hashes: list[int], full: int) -> int:
        """Past `full` cached blocks, a cached block sharing the first k (< what is left) tokens of seq's next
        one: num_computed gains k; returns that block (copied into seq's own before its step) or -1."""
        at = full * BLOCK_SIZE
        room = min(BLOCK_SIZE, len(seq.token_ids) - 1 - at)
        if not self.copy_on_write or seq.fork_count > 1 or room <= 0:
            return -1
        block, k = self.bm.partial_hit(hashes[full - 1] if full else NO_PARENT, seq.lora_id, seq.token_ids[at:at + room])
        seq.num_computed += k
        return block

    def _fork_ready(self, seq: Sequence) -> bool:
        return seq.fork_count > 1 and seq.num_computed >= seq.fork_at

    def _fork(self, parent: Sequence, out: SchedulerOutput) -> list[Sequence]:
        """Split an n > 1 parent into its n samples; they share the prefilled blocks."""
        group = [parent]
        for index in range(1, parent.fork_count):
            child = parent.fork(self.new_seq_id(), index)
            self.bm.fork(child.block_table)
            self.state.fork(parent, child)
            child.status = SeqStatus.RUNNING
            group.append(child)
        parent.fork_count = 1
        at = self.running.index(parent) + 1
        self.running[at:at] = group[1:]
        out.forked += group[1:]
        return group

    def _add_step(self, seq: Sequence, n: int, out: SchedulerOutput, budget: StepBudget) -> None:
        """Add n new tokens of seq to the step, spending them from the budget."""
        start = seq.num_computed - self._overlap(seq)
        end = seq.num_computed + n
        out.seqs.append(seq)
        copy = (seq.cow_source, seq.block_table[start // BLOCK_SIZE]) if seq.cow_source >= 0 else None
        step = self._step_of(seq, start, end, copy)
        out.steps.append(step)
        budget.spend(start, end - start, prefill=end - start - step.num_drafts > 1 or start < seq.prompt_len)
        seq.draft_ids = []                       # fed (or dropped where the budget ran out)

    @staticmethod
    def _step_of(seq: Sequence, start: int, end: int, block_copy: tuple[int, int] | None = None) -> SeqStep:
        """seq's tokens [start, end) as a step, positions past its token_ids taken from its draft_ids. It
        shares seq.block_table, no copy: the table only grows in place (_reserve, admission, and
        plan_decode_ahead while the step runs: blocks past its context), and preempt / finish / advance
        rebind it."""
        num_tokens = len(seq.token_ids)
        drafts = seq.draft_ids[:end - num_tokens] if end > num_tokens else []
        return SeqStep(
            seq_id=seq.seq_id, token_ids=seq.token_ids[start:end] + drafts, start_pos=start,
            block_table=seq.block_table, block_array=seq.block_table_array(),
            sample=end >= num_tokens and seq.fork_count == 1, num_drafts=len(drafts),
            params=seq.params, prompt_len=seq.prompt_len, history=seq.token_ids,
            num_generated=num_tokens - seq.prompt_len,
            want_prompt_logprobs=seq.want_prompt_logprobs and start < seq.prompt_len,
            lora_id=seq.lora_id, state_slot=seq.state_slot, grammar=seq.grammar, block_copy=block_copy,
            kv_from=seq.kv_from)

    # -- the next decode step, planned while this one runs ----------------------------------
    def plan_decode_ahead(self, out: SchedulerOutput, fed: bool = False) -> SchedulerOutput | None:
        """The step after `out`, planned before out's sampled tokens are known: every running
        sequence decodes one more token, its KV block reserved now; each step's token_ids hold a
        placeholder until confirm_decode_ahead. None unless `out` is exactly the running sequences
        each sampling its next token (a decode, or a prompt's last chunk: the first decode goes out
        behind its prefill too; no prompt logprobs, no fork pending), no waiting sequence can join
        (none waits, or max_num_seqs is reached: a busy server's steady state) and their blocks are
        free without preemption: then it is what schedule() will return, unless the running set
        changes first (an end, an abort, an arrival), which confirm_decode_ahead detects.
        fed (async scheduling: the plan is launched before `out`'s tokens are known, its ids taken from
        out's on the device): also None when a sequence's token of `out` is its last by max_tokens, so
        no planned position runs past what admission allowed, or when a sequence has a grammar (its
        mask needs out's token) or penalties (repetition, frequency, presence: they count out's token).
        A fed plan is also a mixed step: after the decodes (the rows whose ids come from `out`, in
        out's order), the prompts `out` left mid-prefill take their next chunk, and waiting sequences
        join as schedule() admits them (their ids are known; a sequence that `out` ends keeps its
        place in max_num_seqs until the step after)."""
        running, tier = self.running, self.host_tier
        if ((not fed and not self._admission_closed()) or len(out.seqs) != len(running) or self.loading
                or (tier is not None and tier.draining) or len(running) > self.max_num_batched_tokens):
            return None                          # (loading sequences join through schedule())
        if fed and {id(s) for s in out.seqs} != {id(s) for s in running}:
            return None
        decodes, chunks, need = [], [], 0
        for seq, step, run in zip(out.seqs, out.steps, running):
            if seq.fork_count > 1 or step.want_prompt_logprobs or seq.want_prompt_logprobs or step.num_drafts:
                return None
            if fed and not step.sample and step.context_len < seq.prompt_len == len(seq.token_ids):
                chunks.append((seq, step))       # a prompt mid-prefill: its next chunk (fed plans only)
                continue
            if ((not fed and seq is not run) or step.context_len != len(seq.token_ids) or not step.sample
                    or (fed and (step.num_generated + 1 >= seq.params.max_tokens or seq.grammar is not None
                                 or counts_history(seq.params)))):
                return None
            decodes.append((seq, step))
            need += max(0, blocks_for(step.context_len + 1) - len(seq.block_table))
        budget, sizes = self.new_budget(), []
        for seq, step in decodes:
            budget.spend(step.context_len, 1, prefill=False)
        for seq, step in chunks:
            n = budget.fit(step.context_len, len(seq.token_ids) - step.context_len)
            if n <= 0:
                return None
            budget.spend(step.context_len, n, prefill=True)
            sizes.append(n)
            need += max(0, blocks_for(step.context_len + n) - len(seq.block_table))
        if not self.bm.can_allocate(need):
            return None
        plan = SchedulerOutput()
        for seq, step in decodes:
            pos = step.context_len
            extra = blocks_for(pos + 1) - len(seq.block_table)
            if extra > 0:                # kept by the sequence even if the plan is dropped
                seq.block_table += self.bm.allocate(extra)
            plan.seqs.append(seq)
            plan.steps.append(SeqStep(
                seq_id=seq.seq_id, token_ids=[-1], start_pos=pos, block_table=seq.block_table,
                block_array=seq.block_table_array(), sample=True, params=seq.params,
                prompt_len=seq.prompt_len, history=seq.token_ids, num_generated=step.num_generated + 1,
                lora_id=seq.lora_id, state_slot=seq.state_slot, grammar=seq.grammar))
        for (seq, step), n in zip(chunks, sizes):
            start, end = step.context_len, step.context_len + n
            extra = blocks_for(end) - len(seq.block_table)
            if extra > 0:
                seq.block_table += self.bm.allocate(extra)
            plan.seqs.append(seq)
            plan.steps.append(self._step_of(seq, start, end))     # (its block copy went with its first chunk)
        if fed:
            self._admit_waiting(plan, budget, self._blocks_in_flight(out))
        return plan

    def _blocks_in_flight(self, out: SchedulerOutput) -> frozenset[int]:
        """Hashes of the full prompt blocks `out` computes (cached when it is done: advance)."""
        if not self.bm.enable_prefix_caching or not self.waiting:
            return frozenset()
        hashes: set[int] = set()
        for seq, step in zip(out.seqs, out.steps):
            if step.start_pos < seq.prompt_len:
                first, last = step.start_pos // BLOCK_SIZE, min(step.context_len, seq.prompt_len) // BLOCK_SIZE
                if last > first:
                    hashes.update(seq.block_hashes(last)[first:])
        return frozenset(hashes)

    def _admission_closed(self) -> bool:
        """schedule() admits nobody this step: nothing waits, or the first waiting sequence (FCFS: the
        only one tried first; those whose LoRA adapter cannot join are passed over) would take the
        running set past max_num_seqs."""
        loras = self._running_loras()
        first = next((s for s in self.waiting if not self._lora_blocked(s, loras)), None)
        return first is None or len(self.running) + len(self.loading) + first.fork_count > self.max_num_seqs

    def confirm_decode_ahead(self, plan: SchedulerOutput) -> bool:
        """Whether a plan_decode_ahead plan is still what schedule() would return now (the same
        running sequences, in order, each with exactly the planned step's token appended and
        accounted, no waiting sequence able to join); if so, patch each step's token in. False: schedule afresh
        (blocks reserved for the plan stay with their sequences and serve that step)."""
        if not self._admission_closed() or len(plan.seqs) != len(self.running) or self.loading:
            return False
        for seq, step, run in zip(plan.seqs, plan.steps, self.running):
            if (seq is not run or seq.status is not SeqStatus.RUNNING or seq.num_computed != step.start_pos
                    or len(seq.token_ids) != step.start_pos + 1):
                return False
        for seq, step in zip(plan.seqs, plan.steps):
            step.token_ids[0] = seq.token_ids[-1]
        return True

    # -- after the step ------------------------------------------------------------------
    def advance(self, out: SchedulerOutput, accepted: list[int] | None = None) -> list[Sequence]:
        """Account the step's computed tokens (before sampled tokens are appended): cache
        newly full blocks, fork n > 1 parents that finished their shared prefill. accepted: per step,
        the draft tokens its verification accepted (None: no step had drafts).
        Returns the forked samples."""
        forked = []
        for i, (seq, step) in enumerate(zip(out.seqs, out.steps)):
            self._release_cow_source(seq)            # the step, its block copy first, is done
            if seq.status is not SeqStatus.RUNNING:
                continue
            kept = accepted[i] if step.num_drafts else 0
            before = seq.num_computed // BLOCK_SIZE
            seq.num_computed = step.context_len - (step.num_drafts - kept)
            after = seq.num_computed // BLOCK_SIZE
            if after > before and self.bm.enable_prefix_caching:
                tokens = seq.token_ids + step.token_ids[len(step.token_ids) - step.num_drafts:][:kept] if kept \
                    else seq.token_ids                # the accepted drafts are appended after this
                self.bm.cache_blocks(seq.block_table[before:after], seq.block_hashes(after, tokens), before, tokens,
                                     seq.lora_id)
            if kept < step.num_drafts:
                self._free_rejected(seq)
            if self._fork_ready(seq):
                forked += self._fork(seq, out)[1:]
        return forked

    def _free_rejected(self, seq: Sequence) -> None:
        """Free the blocks past the one its next token (the verify step's last sampled one) goes to: they
        hold only rejected drafts' KV (never hashed)."""
        keep = blocks_for(seq.num_computed + 1)
        if len(seq.block_table) > keep:
            self.bm.free(seq.block_table[keep:])
            seq.block_table = seq.block_table[:keep]

    def _release_cow_source(self, seq: Sequence) -> None:
        if seq.cow_source >= 0:
            self.bm.free([seq.cow_source])
            seq.cow_source = -1

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its KV, back to the front of the queue."""
        self.running.remove(seq)
        self._release_cow_source(seq)
        if self.host_tier is not None:
            self.host_tier.offload_on_free(seq)
        self.bm.free(seq.block_table)
        seq.block_table, seq.draft_ids = [], []
        seq.num_computed = seq.kv_from = 0
        self.state.release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (done or aborted) and its blocks' references (a loading one's restored blocks
        once their copies land: until then the copies still write them)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.LOADING:
            self.loading.remove(seq)
            self.host_tier.drain(seq)
        if seq.block_table:
            if self.host_tier is not None:
                self.host_tier.offload_on_free(seq)
            self.bm.free(seq.block_table)
        seq.block_table, seq.draft_ids = [], []
        self._release_cow_source(seq)
        self.state.release(seq)
        seq.status = SeqStatus.FINISHED

    # -- the host tier's copies (engine/host_tier.py) ---------------------------------------
    def land_copies(self) -> None:
        """Loading sequences whose copies landed join the running ones; the tier settles the rest that landed."""
        tier = self.host_tier
        if tier is not None and (self.loading or tier.draining or tier.writing):
            for seq in tier.land(self.loading):
                self.loading.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)

    def issue_copies(self) -> None:
        """Before the step: what landed is settled, then the step's host-tier copies go to the executor."""
        if self.host_tier is not None and self.host_tier.on:
            self.land_copies()          # write-through copies that landed give their blocks back
            self.host_tier.issue()
