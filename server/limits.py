"""ServerLimits: what one request may ask for and how long the server waits on a client, so that no
request can stall or slow the others. Each is an `openinfer serve` flag; a bad value is refused at start.

vLLM has no limit on these lists; the defaults are far above what clients send (OpenAI takes at most
4 stop strings; lm-eval sends a few stop strings and one prompt per request unless its batch_size
says otherwise) and far below what slows the engine down.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerLimits:
    max_prompts: int = 256              # prompts in one /v1/completions request (a list of prompts)
    max_stop_strings: int = 64          # `stop` strings per request
    max_stop_chars: int = 1024          # characters in one stop string
    max_stop_token_ids: int = 1024      # `stop_token_ids` per request
    max_logit_bias: int = 1024          # `logit_bias` entries per request
    max_json_depth: int = 64            # nesting of the JSON body (a chat message is 4 deep)
    request_timeout: float = 10.0       # seconds: the headers, then the whole body, each in total
    drain_timeout: float = 30.0         # seconds running requests may take to finish on shutdown

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range."""
        counts = {"max_prompts": self.max_prompts, "max_stop_strings": self.max_stop_strings,
                  "max_stop_chars": self.max_stop_chars, "max_stop_token_ids": self.max_stop_token_ids,
                  "max_logit_bias": self.max_logit_bias, "max_json_depth": self.max_json_depth}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
