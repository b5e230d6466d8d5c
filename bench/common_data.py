"""Benchmark prompts: the random dataset (prompts of an exact token length) and ShareGPT from a local file."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from bench.common import RequestSpec

DEFAULT_TOKENIZER = "/work/shared/models/qwen-tokenizer/tokenizer.json"


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json file, or a folder that holds one."""
    path = Path(path or os.environ.get("OPENINFER_BENCH_TOKENIZER", DEFAULT_TOKENIZER))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path} (pass --tokenizer PATH to a tokenizer.json)")
    return Tokenizer.from_file(str(path))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def allowed_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Every regular vocabulary id (special and added tokens excluded)."""
    added = set(tokenizer.get_added_tokens_decoder())
    return np.array([i for i in range(tokenizer.get_vocab_size(with_added_tokens=False)) if i not in added])


def exact_length_prompt(tokenizer: Tokenizer, token_ids: list[int], allowed: np.ndarray,
                        rng: np.random.Generator, max_rounds: int = 20) -> tuple[str, list[int]]:
    """Text whose encoding has exactly len(token_ids) tokens, starting from those ids.

    Decoding arbitrary ids and re-encoding the text can merge or split tokens, so the length drifts;
    repeat decode -> encode, trimming what is too long and padding what is too short with random ids,
    until the round trip is stable at the target length."""
    target = len(token_ids)
    ids = list(token_ids)
    for _ in range(max_rounds):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        round_trip = encode(tokenizer, text)
        if len(round_trip) == target:
            return text, round_trip
        if len(round_trip) > target:
            ids = round_trip[:target]
        else:
            ids = round_trip + rng.choice(allowed, target - len(round_trip)).tolist()
    raise RuntimeError(f"could not make a prompt of exactly {target} tokens in {max_rounds} rounds")


def random_requests(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                    prefix_len: int = 0, seed: int = 0) -> list[RequestSpec]:
    """`num_prompts` prompts of exactly prefix_len + input_len tokens: one random prefix shared by all,
    then a random body per prompt; each asks for output_len tokens."""
    if input_len < 1 or output_len < 1 or prefix_len < 0 or num_prompts < 1:
        raise ValueError("random dataset needs input_len >= 1, output_len >= 1, prefix_len >= 0, "
                         "num_prompts >= 1")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    # a prefix that survives the round trip on its own, so trimming below only ever cuts the bodies
    prefix = exact_length_prompt(tokenizer, rng.choice(allowed, prefix_len).tolist(), allowed, rng)[1]
    specs = []
    for _ in range(num_prompts):
        body = rng.choice(allowed, input_len).tolist()
        text, ids = exact_length_prompt(tokenizer, prefix + body, allowed, rng)
        specs.append(RequestSpec(prompt=text, prompt_len=len(ids), output_len=output_len))
    return specs


def sharegpt_requests(path: str | os.PathLike, tokenizer: Tokenizer, num_prompts: int,
                      output_len: int | None = None, seed: int = 0,
                      max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[RequestSpec]:
    """First human turn as the prompt, the first reply's token count as the output length (or
    `output_len`), from a local ShareGPT JSON file; like vLLM, pairs shorter than 4 tokens on either
    side, prompts over max_prompt_len and pairs over max_total_len are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path} (--dataset-path must be a local JSON file)")
    conversations = [c.get("conversations") or [] for c in json.loads(path.read_text())]
    conversations = [c for c in conversations if len(c) >= 2]
    random.Random(seed).shuffle(conversations)
    specs = []
    for turns in conversations:
        prompt = turns[0]["value"]
        prompt_len = len(encode(tokenizer, prompt))
        reply_len = output_len or len(encode(tokenizer, turns[1]["value"]))
        if prompt_len < 4 or reply_len < 4 or prompt_len > max_prompt_len \
                or prompt_len + reply_len > max_total_len:
            continue
        specs.append(RequestSpec(prompt=prompt, prompt_len=prompt_len, output_len=reply_len))
        if len(specs) == num_prompts:
            break
    if len(specs) < num_prompts:
        raise ValueError(f"{path} has only {len(specs)} usable conversations, {num_prompts} asked for")
    return specs
