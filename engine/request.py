"""What a client asks for: sampling parameters and the request the engine schedules."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


class ParamRangeError(ValueError):
    """A sampling parameter outside its range: `name` says which, `rule` its range, `value` what it was."""

    def __init__(self, name: str, rule: str, value: object):
        super().__init__(f"{name} {rule}")
        self.name, self.rule, self.value = name, rule, value


@dataclass
class SamplingParams:
    """Per-request sampling semantics. The host sampler (engine/sampling.py) defines them;
    the GPU sampler must reproduce them. temperature == 0 means greedy."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None         # None: none; k: sampled token's logprob + top-k (k <= 20)
    prompt_logprobs: int | None = None  # echo / prompt_logprobs: logprobs of the prompt tokens, top-k of each
    skip_special_tokens: bool = True
    grammar: str | None = None          # structured output: llguidance grammar text (server/structured.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ParamRangeError (a ValueError) naming the field and its allowed range."""
        logprobs, prompt_logprobs = self.logprobs, self.prompt_logprobs
        checks = [
            ("temperature", self.temperature, self.temperature >= 0, "must be >= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k, self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            # bounded so a divided or multiplied float32 logit stays finite (1e-310 made it inf: NaN draws)
            ("repetition_penalty", self.repetition_penalty, 1e-6 <= self.repetition_penalty <= 1e6,
             "must be in [1e-6, 1e6]"),
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens, 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("n", self.n, self.n >= 1, "must be >= 1"),
            ("logprobs", logprobs, logprobs is None or 0 <= logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", prompt_logprobs, prompt_logprobs is None or 0 <= prompt_logprobs <= 20,
             "must be in [0, 20]"),
        ]
        for name, value, ok, rule in checks:
            if not ok:
                raise ParamRangeError(name, rule, value)


@dataclass
class GenerateRequest:
    """One request as the engine sees it: token ids in, a TokenEvent stream out."""
    request_id: str
    prompt_token_ids: list[int]         # or an int array (the server's token-id prompts: no list to pickle)
    params: SamplingParams = field(default_factory=SamplingParams)
    lora_name: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    data_parallel_rank: int | None = None   # the replica to serve it (vLLM's X-data-parallel-rank); None: any
