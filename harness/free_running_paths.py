"""The engine paths of the free-running gate (harness/free_running_oracle.py judges what they generate): how a
set of prompts goes through a hand-driven EngineLoop — batch 1 or batched, the step budget that chunks prefill,
follow-up requests that hit the prefix cache (from the device, or from the host KV tier), a KV pool small enough
to preempt.

    out = engine_greedy(executor, tokenizer, prompts, RunPath("prefix-hit", together=False, follow_up=24))
    verdicts = [judge(oracle, run, tie_tol) for run in out.runs]
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.free_running_oracle import Run, new_engine, run_greedy

NEW_TOKENS = 48                 # greedy tokens per request


@dataclass(frozen=True)
class RunPath:
    """How the engine runs a set of prompts. budget: max_num_batched_tokens (None: the executor's; a prompt
    longer than what is left of it after the step's decodes is prefilled in chunks). together: every prompt
    submitted at once (batched steps of mixed lengths) or each alone after the last. follow_up: once every
    prompt is done, for each one a request whose prompt is that prompt and its first `follow_up` generated tokens
    plus one fresh token, one at a time: they hit the prefix cache on blocks filled in prefill and in decode
    (lines with per-sequence state keep prefix caching off: they recompute). kv_blocks: the engine sees only that
    many blocks of the executor's KV pool (None: all); fewer than the prompts need preempts sequences (they
    resume by recompute), or has evicted the earlier prompts' blocks by the follow-ups' time. host_kv_blocks: the
    host KV tier's slots (the executor built with as many or more), where evicted blocks go and hits come from."""
    name: str
    budget: int | None = None
    together: bool = True
    follow_up: int = 0
    kv_blocks: int | None = None
    host_kv_blocks: int = 0


@dataclass
class GreedyRun:
    runs: list[Run]                     # the prompts' runs in order, then their follow-ups'
    preemptions: int
    host_restored_blocks: int           # prefix-cache blocks brought back from the host KV tier
    accepted_drafts: int = 0            # draft tokens accepted (speculative decoding)


def follow_up_prompt(run: Run, shared: int, vocab_size: int) -> list[int]:
    """run's prompt and first `shared` generated tokens, then one token that is not the next one."""
    head = run.prompt + run.tokens[:shared]
    return head + [(run.tokens[shared] + 1) % vocab_size]


def engine_greedy(executor, tokenizer, prompts: list[list[int]], path: RunPath,
                  new_tokens: int = NEW_TOKENS, speculation=None) -> GreedyRun:
    """Greedy runs of `prompts` (then their follow-ups) through a fresh EngineLoop over `executor`, as `path`
    runs them. speculation: (SpeculativeConfig, its draft proposer or None for the config's) to decode with."""
    config, proposer = speculation or (None, None)
    engine = new_engine(executor, tokenizer, path.budget, path.kv_blocks, path.host_kv_blocks, config)
    if proposer is not None:
        engine.speculator.proposer = proposer
    if path.together:
        runs = run_greedy(engine, prompts, new_tokens)
    else:
        runs = [r for p in prompts for r in run_greedy(engine, [p], new_tokens)]
    if path.follow_up:
        follow = [follow_up_prompt(r, path.follow_up, executor.vocab_size) for r in runs]
        runs += [r for p in follow for r in run_greedy(engine, [p], new_tokens)]
    tier = engine.scheduler.host_tier
    accepted = engine.speculator.counters.num_accepted_tokens if engine.speculator else 0
    return GreedyRun(runs, engine.scheduler.num_preemptions, tier.slots.restored_blocks if tier else 0, accepted)
