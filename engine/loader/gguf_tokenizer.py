"""Build a Hugging Face `tokenizer.json` (+ tokenizer_config) from a GGUF's byte-level BPE
vocabulary, merges and pre-tokenizer name, with `tokenizers` only."""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp pre-tokenizer name -> (split digits one by one first, split regex)
PRE_TOKENIZERS: dict[str, tuple[bool, str]] = {
    "default": (False, _GPT2_SPLIT), "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT), "llama-v3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT), "smaug-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT), "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}


def _pre_tokenizer(pre: str | None):
    digits, split = PRE_TOKENIZERS.get(pre or "default", (None, None))
    if split is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}")
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """meta: the GGUF `tokenizer.*` fields (keys without the `tokenizer.` prefix).
    Returns (tokenizer, tokenizer_config dict)."""
    kind = meta.get("ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(meta["ggml.tokens"])
    types: list[int] = list(meta.get("ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("bos")
    if meta.get("ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {"bos_token": bos, "eos_token": token("eos"), "unk_token": token("unknown"),
              "pad_token": token("padding"), "add_bos_token": bool(meta.get("ggml.add_bos_token")),
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if meta.get("chat_template"):
        config["chat_template"] = meta["chat_template"]
    return tok, config
