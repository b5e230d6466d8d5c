"""Host reference sampler: defines the sampling semantics every sampler (the GPU one too)
must reproduce. Per row, in this order:

1. logit_bias is added to the raw logits.
2. min_tokens: while num_generated < min_tokens, every stop token id is masked to -inf
   (the engine folds EOS into stop_token_ids unless ignore_eos).
3. penalties (as vLLM / OpenAI): repetition_penalty over prompt + output tokens (a positive
   logit is divided by it, a negative one multiplied); frequency_penalty * count and
   presence_penalty * [count > 0] subtracted, counting output tokens only.
3b. structured output: tokens the row's grammar does not allow (engine/grammar.py's bitmask, computed
   for the whole step at once) are masked to -inf; min_tokens yields to the grammar (its stop-token
   mask is skipped where the grammar allows nothing but stop tokens).
4. greedy (temperature == 0): argmax of the result (lowest id on ties).
   Otherwise: divide by temperature, softmax, then min_p (drop p < min_p * max p), top_k
   (keep tokens whose probability is >= the k-th largest: ties at the boundary are kept),
   top_p (keep the most likely tokens, in descending order, until their mass reaches top_p;
   the token that crosses it is kept), renormalize, and draw by inverse CDF over token ids
   with one uniform u ~ U[0, 1) from numpy's default_rng([seed, num_generated]) — so a seeded
   request draws the same whatever else is in the batch, and after a preemption.
Logprobs (sampled token's, and the top-k with k <= 20) are of the RAW model distribution,
log_softmax of the logits before any of the steps above (vLLM's default); prompt logprobs too.

Draft verification (speculative decoding, `verify_seq`): a step with draft tokens d_1..d_k has k + 1 rows;
row j is sampled exactly as the plain decode row after d_1..d_j would be (penalties over the history with
d_1..d_j, min_tokens and the draw's step at num_generated + j, the grammar's mask after d_1..d_j), giving
s_0..s_k. The drafts are accepted while d_{j+1} == s_j; the tokens emitted are d_1..d_a, then s_a. This is
exact rejection sampling for a draft of probability 1 (n-gram, and EAGLE / MTP's greedy drafts): d is
accepted with probability p(d) = min(1, p(d) / q(d)), and on a rejection the emitted s_j is the row's own
draw given s_j != d, distributed as norm(max(0, p - q)) = p without d, renormalized. Greedy is the same rule
with argmax rows. So a request emits, token for token and with the same seed, what it samples without
speculation.
"""
from __future__ import annotations

import numpy as np

from engine.batch import SampledToken, SeqStep
from engine.grammar import allowed_tokens, only_stop_tokens, step_bitmask
from engine.request import SamplingParams


def sample_step(logits: np.ndarray, seqs: list[SeqStep]) -> list[SampledToken]:
    """logits: float32 [R, V], the rows of the SeqSteps with sample=True in order: 1 + num_drafts each
    (ModelBatch.sample_rows). One SampledToken per step."""
    rows = sum(1 + s.num_drafts for s in seqs)
    if len(logits) != rows:
        raise ValueError(f"{len(logits)} logit rows for {len(seqs)} sampled sequences ({rows} rows)")
    if rows != len(seqs):
        out, at = [], 0
        for s in seqs:
            out.append(verify_seq(logits[at:at + 1 + s.num_drafts], s))
            at += 1 + s.num_drafts
        return out
    rows, masks = step_bitmask([s.grammar for s in seqs])
    allowed = dict.fromkeys(range(len(seqs)))
    for i, mask in zip(rows, masks if masks is not None else []):
        allowed[i] = allowed_tokens(mask, logits.shape[1])
    return [sample_row(row, s, allowed[i]) for i, (row, s) in enumerate(zip(logits, seqs))]


def verify_seq(rows: np.ndarray, s: SeqStep) -> SampledToken:
    """Verify s's draft tokens (its last num_drafts token_ids) against its rows [1 + num_drafts, V]; the
    grammar, if any, takes the accepted drafts while the rows are sampled and gives them back after."""
    drafts = s.token_ids[len(s.token_ids) - s.num_drafts:]
    if len(rows) != len(drafts) + 1:
        raise ValueError(f"{len(rows)} rows to verify {len(drafts)} draft tokens")
    accepted: list[SampledToken] = []
    taken = 0                                   # drafts the grammar took
    try:
        for j, raw in enumerate(rows):
            allowed = None if s.grammar is None else allowed_tokens(s.grammar.bitmask(), raw.shape[0])
            token = sample_row(raw, s, allowed, drafts[:j])
            if j == len(drafts) or token.token_id != drafts[j]:
                break
            if s.grammar is not None:
                if not s.grammar.advance_draft(drafts[j]):
                    raise RuntimeError(f"the grammar refused draft token {drafts[j]}, which its mask allowed")
                taken += 1
                if s.grammar.done:              # complete: the sequence ends at this token (and a matcher keeps
                    break                       # no record to roll back of tokens taken after it stopped)
            accepted.append(token)
    finally:
        if taken:
            s.grammar.rollback(taken)
    token.accepted = accepted
    return token


def sample_row(raw: np.ndarray, s: SeqStep, allowed: np.ndarray | None = None, ahead: list[int] = ()) -> SampledToken:
    """allowed: the grammar's bool [V] mask of the row (None: no grammar). ahead: draft tokens between the
    step's history and this row (a verify step's row j: d_1..d_j)."""
    p = s.params
    history = s.history + list(ahead) if ahead else s.history
    step = s.num_generated + len(ahead)
    logits = processed_logits(raw, p, history, s.prompt_len, step, allowed)
    if p.greedy:
        token = int(np.argmax(logits))
    else:
        probs = filtered_probs(logits, p)
        token = draw(probs, 0 if p.seed is None else p.seed, step)
    out = SampledToken(s.seq_id, token)
    if p.logprobs is not None:
        lp = log_softmax(raw)
        out.logprob = float(lp[token])
        out.top_logprobs = top_logprobs(lp, p.logprobs)
    return out


def processed_logits(raw: np.ndarray, p: SamplingParams, history: list[int], prompt_len: int,
                     num_generated: int, allowed: np.ndarray | None = None) -> np.ndarray:
    """Steps 1-3b: logit_bias, min_tokens mask, penalties, the grammar's mask. Returns a new float32
    array."""
    logits = np.array(raw, dtype=np.float32)
    vocab = logits.shape[0]
    for token, bias in p.logit_bias.items():
        if 0 <= int(token) < vocab:
            logits[int(token)] += bias
    if num_generated < p.min_tokens and p.stop_token_ids and not (
            allowed is not None and only_stop_tokens(allowed, p.stop_token_ids)):
        ids = np.asarray([t for t in p.stop_token_ids if 0 <= t < vocab], dtype=np.int64)
        logits[ids] = -np.inf
    if p.repetition_penalty != 1.0 and history:
        seen = np.unique(np.asarray(history, dtype=np.int64))
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(history) > prompt_len:
        counts = np.bincount(np.asarray(history[prompt_len:], dtype=np.int64), minlength=vocab)[:vocab]
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if allowed is not None:
        logits[~allowed] = -np.inf
    return logits


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Step 4 before the draw: temperature, softmax, min_p, top_k, top_p; sums to 1."""
    probs = softmax(logits / np.float32(p.temperature)).astype(np.float64)
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0.0
    if p.top_k != -1 and p.top_k < probs.shape[0]:
        kth = np.partition(probs, -p.top_k)[-p.top_k]
        probs[probs < kth] = 0.0
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        mass_before = (np.cumsum(sorted_probs) - sorted_probs) / sorted_probs.sum()
        probs[order[mass_before >= p.top_p]] = 0.0
    return probs / probs.sum()


def draw(probs: np.ndarray, seed: int, step: int) -> int:
    """Inverse-CDF draw over token ids with u from default_rng([seed, step])."""
    u = np.random.default_rng([seed, step]).random()
    cdf = np.cumsum(probs)
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(token, probs.shape[0] - 1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x)
    return (x - m - np.log(np.sum(np.exp(x - m)))).astype(np.float32)


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob), most likely first, lower id first on ties."""
    if k <= 0:
        return []
    k = min(k, logprobs.shape[0])
    part = np.argpartition(-logprobs, k - 1)[:k]
    order = part[np.lexsort((part, -logprobs[part]))]
    return [(int(t), float(logprobs[t])) for t in order]


def prompt_logprobs(logits: np.ndarray, next_ids: list[int], k: int
                    ) -> tuple[list[float], list[list[tuple[int, float]]], list[int]]:
    """Logprobs of next_ids[i] under logits[i] (raw distribution), each row's top-k, and each token's rank
    in its row (vLLM's: how many tokens are at least as likely, itself included)."""
    lps, tops, ranks = [], [], []
    for row, token in zip(logits, next_ids):
        lp = log_softmax(row)
        lps.append(float(lp[token]))
        tops.append(top_logprobs(lp, k))
        ranks.append(int(np.count_nonzero(lp >= lp[token])))
    return lps, tops, ranks
