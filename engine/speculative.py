"""Speculative decoding settings: vLLM's `--speculative-config` JSON, parsed and checked once, at start.

Keys, as vLLM names them: `method` ("ngram"; "eagle3": an EAGLE-3 head, engine/eagle3.py; "mtp", alias
"deepseek_mtp": the target's own multi-token-prediction layer, engine/mtp.py), `num_speculative_tokens` (k, the draft
tokens proposed per step), `prompt_lookup_min` / `prompt_lookup_max` (ngram: the n-gram sizes looked up; both 5
when neither is given, one given sets the other), `model` (eagle3: the head's folder), and
`num_speculative_tokens_per_batch_size`
(vLLM's per-batch-size schedule: [[lo, hi, k], ...], inclusive ranges from 1 up, a gap taking the entry
before it and sizes past the last its k, each k at most num_speculative_tokens; k = 0 turns drafting off at
those sizes, where verification costs more throughput than it gains), and `disable_by_batch_size` (vLLM's
older switch: no drafts while that many sequences or more run; at least 2). A config with neither takes its
executor's default limit (with_batch_default: on the GPU, no drafts from 32 running sequences on).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from engine.json_flag import json_object

SERVED_METHODS = ("ngram", "eagle3", "mtp")
MTP_ALIASES = ("deepseek_mtp", "qwen3_5_mtp", "qwen3_next_mtp")     # vLLM's older names of "mtp"
MAX_SPECULATIVE_TOKENS = 32
NGRAM_DEFAULT_SIZE = 5                        # vLLM's prompt_lookup_min / _max when neither is given
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
        "num_speculative_tokens_per_batch_size", "disable_by_batch_size")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = NGRAM_DEFAULT_SIZE
    prompt_lookup_max: int = NGRAM_DEFAULT_SIZE
    model: str | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] = ()
    disable_by_batch_size: int | None = None

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse --speculative-config's JSON object; ValueError saying what is wrong."""
        return cls.from_dict(json_object(text))

    @classmethod
    def from_dict(cls, raw: dict) -> SpeculativeConfig:
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
        method = raw.get("method")
        if method is None and raw.get("model") in ("ngram", "[ngram]"):
            method = "ngram"                                    # vLLM infers it from the model name
        if method == "[ngram]":
            method = "ngram"
        if method in MTP_ALIASES:
            method = "mtp"
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        lo, hi = (NGRAM_DEFAULT_SIZE, NGRAM_DEFAULT_SIZE) if lo is None and hi is None else (
            hi if lo is None else lo, lo if hi is None else hi)
        schedule = raw.get("num_speculative_tokens_per_batch_size") or ()
        if not isinstance(schedule, (list, tuple)) or not all(isinstance(e, (list, tuple)) for e in schedule):
            raise ValueError("num_speculative_tokens_per_batch_size must be a list of [lo, hi, k] entries")
        config = cls(method=method, num_speculative_tokens=raw.get("num_speculative_tokens"),
                     prompt_lookup_min=lo, prompt_lookup_max=hi, model=raw.get("model"),
                     num_speculative_tokens_per_batch_size=tuple(tuple(e) for e in schedule),
                     disable_by_batch_size=raw.get("disable_by_batch_size"))
        config.validate()
        return config

    def validate(self) -> None:
        """ValueError naming the key and what it takes, or why the method is not served."""
        if self.method is None:
            raise ValueError(f"method is required (supported: {', '.join(SERVED_METHODS)})")
        if self.method not in SERVED_METHODS:
            raise ValueError(f"method {self.method!r} is not a speculative decoding method this engine knows "
                             f"(supported: {', '.join(SERVED_METHODS)})")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"prompt_lookup_min ({lo!r}) and prompt_lookup_max ({hi!r}) must be integers with "
                             f"1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "ngram" and self.model is not None and self.model != "ngram":
            raise ValueError(f"model {self.model!r}: method 'ngram' takes no draft model")
        if self.method == "eagle3" and not (isinstance(self.model, str) and os.path.isdir(self.model)):
            raise ValueError(f"method 'eagle3' needs \"model\": the folder of an EAGLE-3 draft head (config.json and "
                             f"safetensors), got {self.model!r}")
        if self.method == "mtp" and self.model is not None:
            raise ValueError(f"model {self.model!r}: method 'mtp' drafts with the served model's own "
                             f"multi-token-prediction layers and takes no draft model")
        self._validate_schedule()
        off = self.disable_by_batch_size
        if off is not None and not (_is_int(off) and off >= 2):
            raise ValueError(f"disable_by_batch_size must be an integer >= 2 (the batch size from which drafting is "
                             f"off), got {off!r}")

    def _validate_schedule(self) -> None:
        """vLLM's 3-item form: [lo, hi, k] entries, sorted, not overlapping, the first from batch size 1."""
        end = 0
        for entry in self.num_speculative_tokens_per_batch_size:
            if len(entry) != 3 or not all(_is_int(v) for v in entry):
                raise ValueError(f"num_speculative_tokens_per_batch_size: entry {list(entry)} is not [lo, hi, k] "
                                 f"of integers (the 5-item form with context ranges is not supported)")
            lo, hi, k = entry
            if not 1 <= lo <= hi or k < 0:
                raise ValueError(f"num_speculative_tokens_per_batch_size: entry {list(entry)} needs 1 <= lo <= hi "
                                 f"and k >= 0")
            if lo <= end or (end == 0 and lo != 1):
                raise ValueError("num_speculative_tokens_per_batch_size: ranges must be sorted, not overlap, and "
                                 "the first must start at batch size 1")
            end = hi

    def tokens_for_batch(self, batch_size: int) -> int:
        """k for a step of batch_size running sequences (the schedule's entry covering it, a gap the entry before
        it, past the last entry its k; k with no schedule), at most num_speculative_tokens; 0 from
        disable_by_batch_size on."""
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return 0
        k = self.num_speculative_tokens
        for lo, _hi, entry_k in self.num_speculative_tokens_per_batch_size:
            if batch_size < lo:
                break
            k = min(entry_k, self.num_speculative_tokens)
        return k


def with_batch_default(config: SpeculativeConfig, off_batch_size: int | None) -> SpeculativeConfig:
    """config, or where it sets no batch-size schedule (neither num_speculative_tokens_per_batch_size nor
    disable_by_batch_size), the executor's default: disable_by_batch_size = off_batch_size (None: none).
    The GPU's is 32: a verify step's batch x (k + 1) rows (160 at k = 4) reach the GEMMs' compute-bound side
    there, so its cost grows with them (Qwen3-8B, k = 4: 1.05x a decode step at batch 1, 1.25x at 32) while a
    plain step already fills the GPU; at the demo model's batch 80, k = 4 gave 0.49-0.56x the tokens/s
    (bench/results/speculative.md). The numpy executor's is none (its tests draft at every batch size)."""
    if off_batch_size is None or config.num_speculative_tokens_per_batch_size or config.disable_by_batch_size:
        return config
    return replace(config, disable_by_batch_size=off_batch_size)


def check_device(config: SpeculativeConfig | None, device: str, tensor_parallel_size: int = 1) -> None:
    """Refuse (ValueError) before the model is loaded what no executor of this device serves: on the GPU, MTP
    layers (method 'mtp' drafts on the numpy executor only), and speculation across tensor-parallel ranks (the
    ranks replay rank 0's decode steps; a verify step's rows are sampled and accepted on rank 0 alone, which the
    ranks' lock-step does not carry yet)."""
    if config is not None and device != "cpu" and config.method == "mtp":
        raise ValueError("--speculative-config: method 'mtp' (the model's multi-token-prediction layers) drafts on "
                         "the numpy executor only for now (--device cpu); on the GPU use 'ngram', or 'eagle3' with "
                         "a draft head")
    if config is not None and device != "cpu" and tensor_parallel_size > 1:
        raise ValueError(f"--speculative-config: the GPU executor verifies draft tokens on one GPU; with "
                         f"--tensor-parallel-size {tensor_parallel_size} speculative decoding is not served yet "
                         f"(serve with --tensor-parallel-size 1, or without --speculative-config)")


def check_speculation(config: SpeculativeConfig, executor) -> None:
    """Refuse (ValueError) a speculative config the executor or the model line cannot serve."""
    if not executor.supports_draft_verify:
        raise ValueError(f"--speculative-config: {type(executor).__name__} does not verify draft tokens yet "
                         f"(the numpy executor and the one-GPU executor do)")
    if config.method == "eagle3" and not executor.supports_eagle3:
        raise ValueError(f"--speculative-config: {type(executor).__name__} does not run EAGLE-3 heads yet (the numpy "
                         f"executor and the one-GPU executor do)")
    if config.method == "mtp" and not executor.supports_mtp:
        raise ValueError(f"--speculative-config: {type(executor).__name__} does not run multi-token-prediction "
                         f"layers yet (method 'mtp' is served by the numpy executor, --device cpu)")
    if executor.num_state_slots and not executor.rolls_back_state:
        raise ValueError(_state_refusal(executor))


def _state_refusal(executor) -> str:
    """Why the model's per-sequence state cannot take a verify step's rejected drafts on this executor."""
    if "dsv4" in executor.rank0().model.op_families:
        return (f"--speculative-config: DeepSeek-V4 keeps compressor rings per sequence (each compressed layer's "
                f"last tokens' compressor inputs), which the rejected draft tokens of a verify step would overwrite; "
                f"{type(executor).__name__} does not size them for drafts yet; the numpy executor and the one-GPU "
                f"executor do: serve it on one of them, or without --speculative-config")
    return (f"--speculative-config: this model keeps per-sequence state (Qwen3.5's Gated DeltaNet conv windows and "
            f"recurrent states), which {type(executor).__name__} does not roll back past a verify step's rejected "
            f"draft tokens yet; the numpy executor and the one-GPU executor do: serve it on one of them, or without "
            f"--speculative-config")
