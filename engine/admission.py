"""Request admission: whether a GenerateRequest can run here (every check in one place) and the
Sequence it becomes (a concrete seed, EOS folded into its stop tokens, its grammar's matcher)."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np

from engine.grammar import GrammarCache
from engine.request import GenerateRequest
from engine.sequence import Sequence
from memory.kv_pool import BLOCK_SIZE, blocks_for


def first_bad_token(prompt, vocab_size: int) -> int | None:
    """The index of the first entry of prompt that is not an int id in [0, vocab_size), or None. One numpy pass for a
    prompt of plain ints (a 16k-token prompt: ~0.3 ms on the engine thread instead of ~2 ms of Python);
    anything else (floats, huge ints, other types) is walked to name the culprit."""
    a = np.asarray(prompt) if isinstance(prompt, (list, np.ndarray)) else None
    if a is not None and a.dtype.kind in "iu" and a.ndim == 1:
        if a.size == 0 or (int(a.min()) >= 0 and int(a.max()) < vocab_size):
            return None
        return int(np.flatnonzero((a < 0) | (a >= vocab_size))[0])
    for i, t in enumerate(prompt):
        if not (isinstance(t, int) and 0 <= t < vocab_size):
            return i
    return None


@dataclass(frozen=True)
class AdmissionLimits:
    vocab_size: int
    max_model_len: int
    max_n: int                  # samples per request (already capped by max_num_seqs)
    num_kv_blocks: int


class Admission:
    def __init__(self, limits: AdmissionLimits, eos_token_ids: list[int], seed: int,
                 grammars: GrammarCache | None = None, loras=None):
        self.limits = limits
        self.loras = loras              # engine/lora_registry.LoRARegistry (None: LoRA off)
        self.eos_token_ids = list(eos_token_ids)
        self._seed_rng = random.Random(seed)
        self.grammars = grammars        # None: structured output is refused

    def reject_reason(self, req: GenerateRequest, in_flight) -> str | None:
        """Why the request cannot run (naming the field), or None. in_flight: request ids running now."""
        lim, p = self.limits, req.params
        try:
            p.validate()
        except ValueError as e:
            return str(e)
        prompt = req.prompt_token_ids
        if req.lora_name is not None and self.loras is None:
            return f"lora_name {req.lora_name!r}: LoRA is not enabled (start the engine with --enable-lora)"
        if req.lora_name is not None and self.loras.id_of(req.lora_name) is None:
            return f"lora_name {req.lora_name!r}: no LoRA adapter of that name is loaded"
        if req.request_id in in_flight:
            return f"request_id {req.request_id!r} is already in flight"
        if len(prompt) == 0:
            return "prompt is empty: at least one token is needed"
        bad = first_bad_token(prompt, lim.vocab_size)
        if bad is not None:
            t = prompt[bad]
            return (f"prompt token id {int(t) if isinstance(t, np.integer) else t!r} is out of the vocabulary "
                    f"range [0, {lim.vocab_size})")
        if len(prompt) + p.max_tokens > lim.max_model_len:
            return (f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) = "
                    f"{len(prompt) + p.max_tokens} exceeds max_model_len ({lim.max_model_len})")
        if p.n > lim.max_n:
            return f"n must be <= {lim.max_n}, got {p.n}"
        if blocks_for(len(prompt) + p.max_tokens) > lim.num_kv_blocks:
            return (f"prompt + max_tokens ({len(prompt) + p.max_tokens} tokens) needs more KV "
                    f"cache than the engine has ({lim.num_kv_blocks * BLOCK_SIZE} tokens)")
        for t in list(p.logit_bias) + list(p.stop_token_ids):
            if not 0 <= int(t) < lim.vocab_size:
                return f"token id {t} (logit_bias / stop_token_ids) is out of the vocabulary range"
        if p.grammar is not None:
            if self.grammars is None:
                return "grammar: structured output is not available with this tokenizer"
            problem = self.grammars.check(p.grammar)
            if problem is not None:
                return f"grammar does not compile: {problem}"
        return None

    def sequence(self, req: GenerateRequest, seq_id: int) -> Sequence:
        """The request's first Sequence with its effective parameters."""
        p = req.params
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else
                                          [t for t in self.eos_token_ids if t not in p.stop_token_ids])
        # any int seed (OpenAI's are signed 64-bit) maps to the sampler's non-negative range
        seed = p.seed % (1 << 64) if p.seed is not None else self._seed_rng.getrandbits(63)
        params = dataclasses.replace(p, seed=seed, stop_token_ids=stops)
        grammar = self.grammars.matcher(p.grammar) if p.grammar is not None else None
        prompt = req.prompt_token_ids
        array = isinstance(prompt, np.ndarray)
        return Sequence(seq_id=seq_id, request_id=req.request_id, token_ids=prompt.tolist() if array else list(prompt),
                        prompt_len=len(prompt), params=params, arrival=req.arrival_time,
                        prompt_array=prompt if array else None,
                        lora_id=self.loras.id_of(req.lora_name) if req.lora_name is not None else 0,
                        fork_count=p.n, want_prompt_logprobs=p.prompt_logprobs is not None, grammar=grammar)
