"""StepLimits: the step and sequence limits, resolved once at start and checked there; the executor is
built for them (engine/executor/options.py) and the scheduler plans within them, so the two never
disagree and nothing downstream re-derives or re-checks a limit.
"""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's defaults on a GPU. On the CPU the executor's cost model bounds a step's time as well (0.35 s on a core of
# the 2-core machine: engine/executor/cpu_cost.py); 76 tokens of a fresh prompt alone are ~0.29 s of it, so alone
# the tokens bind, and beside decodes or late in a long prompt the time.
DEFAULT_LIMITS = {"cuda": (256, 8192), "cpu": (64, 76)}   # device -> (max_num_seqs, max_num_batched_tokens)


@dataclass(frozen=True)
class StepLimits:
    """max_model_len: tokens per sequence (prompt + output); max_num_seqs / max_num_batched_tokens:
    sequences / tokens per step; chunked_prefill: a prompt longer than a step's tokens is split over
    several steps (off: it must fit one). Checked when made: ValueError naming the flag."""
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        tokens, seqs, length = self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len
        if tokens < seqs:
            raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs ({seqs}): a decode "
                             f"step of every sequence feeds one token each")
        if not self.chunked_prefill and tokens < length:
            raise ValueError(f"max_num_batched_tokens ({tokens}) is below max_model_len ({length}) with chunked "
                             f"prefill off: a longer prompt could never be scheduled; raise "
                             f"--max-num-batched-tokens, lower --max-model-len or enable chunked prefill")


def resolve_limits(config, device: str, model_max_len: int) -> StepLimits:
    """An EngineConfig's limits on a resolved device ("cpu" / "cuda") for a model whose own context is
    model_max_len (its max_position_embeddings): the flags where given, else the device's defaults."""
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(f"max_model_len ({config.max_model_len}) is more than the model's context "
                         f"(max_position_embeddings {model_max_len})")
    seqs, tokens = DEFAULT_LIMITS[device]
    seqs = config.max_num_seqs or seqs
    tokens = config.max_num_batched_tokens or max(tokens, seqs)
    return StepLimits(config.max_model_len or model_max_len, seqs, tokens, config.enable_chunked_prefill)


def limits_within(options, config, max_model_len: int) -> StepLimits:
    """The limits of an engine over an executor built elsewhere (with `options`): the config's where it
    sets them, else the executor's; refused (ValueError) where the executor was built for less."""
    tokens = config.max_num_batched_tokens or options.max_num_batched_tokens
    seqs = config.max_num_seqs or min(options.max_num_seqs, tokens)
    for name, want, have in (("max_num_seqs", seqs, options.max_num_seqs),
                             ("max_num_batched_tokens", tokens, options.max_num_batched_tokens),
                             ("max_model_len", max_model_len, options.max_model_len)):
        if want > have:
            raise ValueError(f"{name} {want} is more than the executor was built for ({have})")
    return StepLimits(max_model_len, seqs, tokens, config.enable_chunked_prefill)
