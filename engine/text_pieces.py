"""Long texts tokenized in parallel, exactly: cut where the tokenizer's pre-tokenizer cuts anyway.

A byte-level BPE never merges across its pre-tokenizer's pieces, so a text cut at a piece boundary
tokenizes to the concatenation of its parts' tokens; `tokenizers`' encode_batch then runs the parts on
all cores (a 16k-token prompt is 40-100 ms of one core otherwise, the largest part of a prefix hit's TTFT
for a text prompt; a 1k-token prompt's 2-3 ms are a tenth of its cold TTFT). Only tokenizers whose pieces are known are cut (`splitter` returns None for the rest):
no normalizer (or NFC), the GPT-4-style split regex of Qwen2/2.5/3 or Llama 3 followed by a ByteLevel
without its own regex or prefix space, and no added token containing whitespace or stripping it. For those regexes both
kinds of cut are boundaries, whatever surrounds them:
  * after a run of newlines, before a character that is not whitespace (`\\s*[\\r\\n]+` takes the whole
    run, with any blanks before it, ahead of the whitespace rules, and the next piece starts after it);
  * before a single space between two letters (`[^\\r\\n\\p{L}\\p{N}]?\\p{L}+` ends the word before it and
    starts the next word with the space).
The post-processor's special tokens (a BOS) are taken from a probe and put in front once. At most one
part per core but one, so the server's event loop keeps a core (a 2-core machine does not cut at all).
"""
from __future__ import annotations

import json
import os

SPLIT_PATTERNS = (       # Qwen2 / 2.5 / 3, Llama 3 (pre_tokenizer Split, behavior Isolated)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
MIN_CHARS = 2_000        # shorter texts (~400 tokens): one encode (0.6 ms for 256 tokens here)
PIECE_CHARS = 1_000      # the smallest part (a 1k-token text, ~5k characters: 2.9 ms in one encode here)
SEARCH_CHARS = 500       # how far past a target position a cut is looked for


def known_pieces(spec: dict) -> bool:
    """Whether tokenizer.json's normalizer, pre-tokenizer and added tokens are ones cut() is exact for."""
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        return False
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not parts or len(parts) != 2:
        return False
    split, byte_level = parts
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or (split.get("pattern") or {}).get("Regex") not in SPLIT_PATTERNS):
        return False
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex") or byte_level.get("add_prefix_space"):
        return False
    return not any(t.get("lstrip") or t.get("rstrip") or any(c.isspace() for c in t.get("content", ""))
                   for t in spec.get("added_tokens", []))      # (a stripping token takes the blanks beside it)


def cut(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` in parts of about piece_chars characters, each cut at a boundary of the pre-tokenizer (or
    the whole text where none is near enough)."""
    parts, start, n = [], 0, len(text)
    while n - start > piece_chars + SEARCH_CHARS:
        at = _boundary(text, start + piece_chars, min(n - 1, start + piece_chars + SEARCH_CHARS))
        if at is None:
            break
        parts.append(text[start:at])
        start = at
    parts.append(text[start:])
    return parts


def _boundary(text: str, lo: int, hi: int) -> int | None:
    for p in range(lo, hi):
        c = text[p]
        if text[p - 1] == "\n" and not c.isspace():
            return p
        if c == " " and text[p - 1].isalpha() and text[p + 1].isalpha():
            return p
    return None


class Splitter:
    """encode(text, add_special_tokens) through cut parts; built by `splitter` for a known tokenizer."""

    def __init__(self, tok, prefix: dict[bool, list[int]], max_parts: int | None = None):
        self.tok, self.prefix = tok, prefix
        self.max_parts = max(1, (os.cpu_count() or 1) - 1) if max_parts is None else max_parts

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The ids, or None where the text is too short to be worth cutting (the caller encodes it)."""
        if len(text) < MIN_CHARS or self.max_parts < 2:
            return None
        parts = cut(text, max(PIECE_CHARS, -(-len(text) // self.max_parts)))
        if len(parts) < 2:
            return None
        ids = list(self.prefix[add_special_tokens])
        for enc in self.tok.encode_batch(parts, add_special_tokens=False):
            ids += enc.ids
        return ids


def splitter(tok) -> Splitter | None:
    """A Splitter for this `tokenizers.Tokenizer`, or None where cutting is not known to be exact (then
    the post-processor must add only a fixed prefix: checked on two probes)."""
    try:
        if not known_pieces(json.loads(tok.to_str())):
            return None
    except (ValueError, AttributeError, TypeError):
        return None
    prefix = {False: []}
    for probe in ("probe text", "another\nprobe"):
        bare = tok.encode(probe, add_special_tokens=False).ids
        full = tok.encode(probe, add_special_tokens=True).ids
        if full[len(full) - len(bare):] != bare or prefix.setdefault(True, full[:len(full) - len(bare)]) != \
                full[:len(full) - len(bare)]:
            return None
    return Splitter(tok, prefix)
