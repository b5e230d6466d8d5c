"""Speculative decoding in the engine loop: before each step, draft tokens for the running sequences that
decode (Sequence.draft_ids, which the scheduler feeds after the sequence's last token: k + 1 query tokens,
their KV slots); after it, the acceptance counters (vLLM's spec_decode_* metrics).

How many drafts a sequence gets: the config's k for the step's batch size (tokens_for_batch; a config without a
schedule takes the executor's default limit, speculative.py with_batch_default), and never so
many that the accepted drafts and the token after them could run past max_tokens or max_model_len; a
sequence under a grammar keeps only the drafts its grammar accepts (a refused token would be rejected by the
masked verification anyway). The executor verifies (engine/sampling.py verify_seq); the scheduler keeps the
accepted tokens' KV, frees what only rejected ones used and hashes only accepted tokens' blocks.
Between steps, draft_free_next predicts whether the next step goes without drafts, so the engine loop keeps its
overlap (planning or launching that step ahead) where it does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.batch import SampledToken, SeqStep
from engine.eagle3 import load_eagle3_head
from engine.mtp import load_mtp_layer
from engine.ngram import DraftProposer, NgramProposer
from engine.sequence import SeqStatus, Sequence
from engine.speculative import SpeculativeConfig, check_speculation, with_batch_default


@dataclass
class SpecDecodeCounters:
    """vLLM's spec_decode counters: verify steps with drafts (one per sequence and step), draft tokens
    verified, draft tokens accepted, and accepted ones by their position in the draft."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: DraftProposer | None = None,
                 draft_states=None):
        """draft_states: what keeps per-sequence draft state (an EAGLE-3 or MTP draft: keep(seq_ids) drops the
        others'); None: the proposer keeps none."""
        self.config, self.max_model_len = config, max_model_len
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_states = draft_states
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        # prompt lookup drafts from the ids alone: a step may go without them, planned or launched (fed) ahead
        self.feeds_ok = config.method == "ngram"
        self.found: tuple[dict[int, int], bool] = ({}, True)   # the last look: ids' lengths, whether any drafted

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's draft_ids for the next step ([] where it gets none)."""
        if self.draft_states is not None:
            self.draft_states.keep({seq.seq_id for seq in running})
        k = self.config.tokens_for_batch(len(running))
        seqs, limits = [], []
        for seq in running:
            seq.draft_ids = []
            limit = min(k, self.room(seq)) if k and decoding(seq) else 0
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if seqs:
            for seq, limit, drafts in zip(seqs, limits, self.proposer.propose(seqs, limits)):
                drafts = [int(t) for t in drafts[:limit]]
                if seq.grammar is not None and drafts:
                    drafts = drafts[:seq.grammar.valid_prefix(drafts)]
                seq.draft_ids = drafts
        if self.feeds_ok:                   # draft_free_next's answer while the ids stay as they are
            self.found = (lengths(running), any(seq.draft_ids for seq in seqs))

    def draft_free_next(self, running: list[Sequence]) -> bool:
        """Whether the next step goes without drafts, so the engine loop may plan or launch it ahead while this one
        runs (the overlap): drafting is off at this batch size, or (prompt lookup only) no running sequence has a
        draft at the ids known now, the last look's where they have not changed since. A draft that turns up at the
        next step's ids is then proposed a step later, from the ids of that step."""
        if not self.config.tokens_for_batch(len(running)):
            return True
        if not self.feeds_ok:
            return False
        known, drafted = self.found
        if known == lengths(running):
            return not drafted
        seqs = [s for s in running if s.status is SeqStatus.RUNNING and self.room(s) > 0]
        probe = getattr(self.proposer, "none_drafted", None)    # a device proposer's look without a wait
        drafted = (not probe(seqs) if probe is not None else
                   any(self.proposer.propose(seqs, [min(self.config.num_speculative_tokens, self.room(s))
                                                    for s in seqs])) if seqs else False)
        self.found = (lengths(running), drafted)
        return not drafted

    def room(self, seq: Sequence) -> int:
        """Drafts that fit: the accepted ones and the token after them within max_tokens, the last draft's
        position within max_model_len."""
        return min(seq.params.max_tokens - seq.num_generated - 1, self.max_model_len - len(seq.token_ids))

    def record(self, steps: list[SeqStep], sampled: list[SampledToken], running: list[Sequence] = ()) -> None:
        """Count a finished step's verified drafts (sampled: one per step with sample set, in order); drop the
        draft state of sequences no longer `running` (finished, aborted, preempted) at once."""
        if self.draft_states is not None:
            self.draft_states.keep({seq.seq_id for seq in running})
        c = self.counters
        tokens = iter(sampled)
        for step in steps:
            token = next(tokens) if step.sample else None
            if token is None or not step.num_drafts:
                continue
            accepted = len(token.accepted)
            c.num_drafts += 1
            c.num_draft_tokens += step.num_drafts
            c.num_accepted_tokens += accepted
            for pos in range(accepted):
                c.accepted_per_pos[pos] += 1


def lengths(running: list[Sequence]) -> dict[int, int]:
    return {seq.seq_id: len(seq.token_ids) for seq in running}


def decoding(seq: Sequence) -> bool:
    """seq runs its next step as a decode: prefill done, its last token not yet computed, no fork or prompt
    logprobs pending."""
    return (seq.status is SeqStatus.RUNNING and seq.fork_count == 1 and not seq.want_prompt_logprobs
            and seq.num_computed == len(seq.token_ids) - 1)


def speculator_for(config: SpeculativeConfig | None, executor, max_model_len: int) -> Speculator | None:
    """The engine's Speculator (None: speculation off); ValueError where the executor or model cannot serve it."""
    if config is None:
        return None
    check_speculation(config, executor)
    config = with_batch_default(config, executor.spec_off_batch_size)
    if config.method == "eagle3":
        draft = executor.attach_eagle3(load_eagle3_head(config.model, executor.config))
        return Speculator(config, max_model_len, draft, draft_states=draft)
    if config.method == "mtp":
        draft = executor.attach_mtp(load_mtp_layer(executor.model_path, executor.model))
        return Speculator(config, max_model_len, draft, draft_states=draft)
    if executor.supports_device_ngram:
        draft = executor.attach_ngram(config)
        return Speculator(config, max_model_len, draft, draft_states=draft)
    return Speculator(config, max_model_len)
